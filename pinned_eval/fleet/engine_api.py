"""Control-plane calls to one engine, always direct (sglang-router does not proxy them).

Contract (SGLang 0.5.2 .. 0.5.23, see the protocol reference §1):
- `model_info` reads `GET /model_info`, falling back to `GET /get_model_info` on 404 only.
- `load` posts `/update_weights_from_disk` with `abort_all_requests` and `flush_cache` and a long
  timeout; it never raises on a failed load, it returns a `LoadOutcome` (400 = rejected, weights
  unknown afterwards).
- A reply that is not the JSON the protocol promises raises `EngineHTTPError` naming the endpoint
  and the field (never a bare decode/validation error).
- LoRA: `load_lora`/`unload_lora` post SGLang's `/load_lora_adapter`/`/unload_lora_adapter` and
  return a `LoadOutcome` (a 400 `success: false` is "rejected" with SGLang's `error_message`);
  `lora_adapters` reads the loaded adapters from `/v1/models`.
- Auth: control endpoints take the admin key when one is set, else the API key; data-plane
  reads (`/model_info`, `/server_info`) take the API key. `/health` is always open.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from pinned_eval.fleet.errors import EngineHTTPError
from pinned_eval.fleet.models import (
    EngineInfo,
    LoadOutcome,
    LoRAUpdateOutput,
    ModelList,
    normalize_path,
    normalize_url,
)

M = TypeVar("M", bound=BaseModel)


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _message(resp: httpx.Response) -> str:
    """The `message` of an SGLang JSON reply, else its text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text
    if isinstance(body, dict):
        for key in ("message", "error", "detail"):
            if key in body:
                return str(body[key])
    return resp.text


def parse_reply(url: str, endpoint: str, resp: httpx.Response, model: type[M], extra: dict[str, Any]) -> M:
    """A 200 reply as `model`; a body that is not a JSON object or misses/mistypes a field is an
    `EngineHTTPError` naming the endpoint and the field (a misbehaving engine, not a crash)."""
    try:
        body = resp.json()
    except ValueError:
        raise EngineHTTPError(url, resp.status_code, f"{endpoint}: reply is not JSON: {resp.text[:200]!r}") from None
    if not isinstance(body, dict):
        raise EngineHTTPError(url, resp.status_code, f"{endpoint}: reply is not a JSON object: {resp.text[:200]!r}")
    try:
        return model.model_validate({**body, **extra})
    except ValidationError as exc:
        bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise EngineHTTPError(url, resp.status_code, f"{endpoint}: {bad}") from None


class EngineAPI:
    """Thin typed wrapper over one shared `httpx.AsyncClient` for per-engine control calls."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        load_timeout_s: float = 600.0,
        health_timeout_s: float = 30.0,
        info_timeout_s: float = 30.0,
    ) -> None:
        self._http = http
        self._data_headers = bearer(api_key)
        self._admin_headers = bearer(admin_api_key or api_key)
        self.load_timeout_s = load_timeout_s
        self.health_timeout_s = health_timeout_s
        self.info_timeout_s = info_timeout_s

    async def model_info(self, url: str) -> EngineInfo:
        """Live weight version and model path. Transport errors propagate (`httpx.TransportError`)."""
        url = normalize_url(url)
        resp = await self._http.get(f"{url}/model_info", headers=self._data_headers, timeout=self.info_timeout_s)
        if resp.status_code == 404:
            resp = await self._http.get(
                f"{url}/get_model_info", headers=self._data_headers, timeout=self.info_timeout_s
            )
        if resp.status_code != 200:
            raise EngineHTTPError(url, resp.status_code, resp.text)
        return parse_reply(url, "/model_info", resp, EngineInfo, {"url": url})

    async def server_info(self, url: str) -> dict[str, Any]:
        """Startup server args (`/server_info`, falling back to `/get_server_info`); not the live version."""
        url = normalize_url(url)
        resp = await self._http.get(f"{url}/server_info", headers=self._data_headers, timeout=self.info_timeout_s)
        if resp.status_code == 404:
            resp = await self._http.get(
                f"{url}/get_server_info", headers=self._data_headers, timeout=self.info_timeout_s
            )
        if resp.status_code != 200:
            raise EngineHTTPError(url, resp.status_code, resp.text)
        body = resp.json()
        if not isinstance(body, dict):
            raise EngineHTTPError(url, resp.status_code, f"server_info is not an object: {resp.text[:200]}")
        return body

    async def health(self, url: str) -> int:
        """Status of `GET /health` (SGLang generates one token there). Transport errors propagate."""
        resp = await self._http.get(
            f"{normalize_url(url)}/health", headers=self._data_headers, timeout=self.health_timeout_s
        )
        return resp.status_code

    async def load(
        self,
        url: str,
        model_path: str,
        weight_version: str,
        *,
        abort_all_requests: bool = True,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> LoadOutcome:
        """Load a snapshot from disk; the engine sets `weight_version` only if the load succeeds."""
        url = normalize_url(url)
        body: dict[str, Any] = {
            "model_path": model_path,
            "weight_version": weight_version,
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            body["load_format"] = load_format
        try:
            resp = await self._http.post(
                f"{url}/update_weights_from_disk",
                json=body,
                headers=self._admin_headers,
                timeout=self.load_timeout_s,
            )
        except httpx.TimeoutException as exc:
            return LoadOutcome(
                url=url, ok=False, message=f"no answer in {self.load_timeout_s}s: {exc!r}", error="timeout"
            )
        except httpx.TransportError as exc:
            return LoadOutcome(url=url, ok=False, message=repr(exc), error="connection")
        if resp.status_code == 200:
            payload = resp.json()
            success = bool(payload.get("success", True)) if isinstance(payload, dict) else True
            return LoadOutcome(
                url=url,
                ok=success,
                status_code=200,
                message=_message(resp),
                error=None if success else "rejected",
            )
        kind: Literal["rejected", "http"] = "rejected" if resp.status_code == 400 else "http"
        return LoadOutcome(url=url, ok=False, status_code=resp.status_code, message=_message(resp), error=kind)

    async def set_weight_version(self, url: str, new_version: str, *, abort_all_requests: bool = False) -> None:
        """Relabel the live weights (`/update_weight_version`); SGLang aborts everything by default."""
        url = normalize_url(url)
        resp = await self._http.post(
            f"{url}/update_weight_version",
            json={"new_version": new_version, "abort_all_requests": abort_all_requests},
            headers=self._admin_headers,
            timeout=self.info_timeout_s,
        )
        if resp.status_code != 200:
            raise EngineHTTPError(url, resp.status_code, resp.text)

    async def load_lora(self, url: str, lora_name: str, lora_path: str) -> LoadOutcome:
        """`POST /load_lora_adapter`; never raises on a refused adapter (400 `error_message`)."""
        return await self._lora_update(url, "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    async def unload_lora(self, url: str, lora_name: str) -> LoadOutcome:
        """`POST /unload_lora_adapter` (SGLang waits for the requests using it)."""
        return await self._lora_update(url, "/unload_lora_adapter", {"lora_name": lora_name})

    async def lora_adapters(self, url: str) -> dict[str, str]:
        """Loaded adapters, name -> path: the `/v1/models` cards that have a `parent` (SGLang lists
        the base model first, then one card per adapter with `root` = its path)."""
        url = normalize_url(url)
        resp = await self._http.get(f"{url}/v1/models", headers=self._data_headers, timeout=self.info_timeout_s)
        if resp.status_code != 200:
            raise EngineHTTPError(url, resp.status_code, resp.text)
        cards = parse_reply(url, "/v1/models", resp, ModelList, {}).data
        return {c.id: normalize_path(c.root) if c.root else "" for c in cards if c.parent is not None}

    async def _lora_update(self, url: str, path: str, body: dict[str, Any]) -> LoadOutcome:
        url = normalize_url(url)
        try:
            resp = await self._http.post(
                f"{url}{path}", json=body, headers=self._admin_headers, timeout=self.load_timeout_s
            )
        except httpx.TimeoutException as exc:
            return LoadOutcome(url=url, ok=False, message=f"{path}: no answer in {self.load_timeout_s}s: {exc!r}",
                               error="timeout")
        except httpx.TransportError as exc:
            return LoadOutcome(url=url, ok=False, message=f"{path}: {exc!r}", error="connection")
        if resp.status_code not in (200, 400):
            return LoadOutcome(url=url, ok=False, status_code=resp.status_code, message=resp.text[:500], error="http")
        reply = parse_reply(url, path, resp, LoRAUpdateOutput, {})
        return LoadOutcome(
            url=url,
            ok=reply.success and resp.status_code == 200,
            status_code=resp.status_code,
            message=reply.error_message or "",
            error=None if reply.success and resp.status_code == 200 else "rejected",
        )

    async def pause(self, url: str, mode: Literal["abort", "retract", "in_place"] = "abort") -> None:
        await self._control(url, "/pause_generation", {"mode": mode})

    async def resume(self, url: str) -> None:
        await self._control(url, "/continue_generation", {})

    async def _control(self, url: str, path: str, body: dict[str, Any]) -> None:
        url = normalize_url(url)
        resp = await self._http.post(
            f"{url}{path}", json=body, headers=self._admin_headers, timeout=self.info_timeout_s
        )
        if resp.status_code != 200:
            raise EngineHTTPError(url, resp.status_code, resp.text)
