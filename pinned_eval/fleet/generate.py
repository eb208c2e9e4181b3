"""Generation through sglang-router: one prompt per request, aborts retried, versions checked.

Contract:
- Bodies are built by `build_generate_body` only: exactly one of `text` (one string; the router
  422s on a text batch) or `input_ids` (flat ids), `sampling_params` from `SamplingParams`
  (SGLang names, `sampling_seed` for the seed), optional `rid`, optional `lora_path` (adapter name).
- A router 503 (no healthy worker during a health-check cycle) is retried with backoff, boundedly.
- A response whose `finish_reason.type == "abort"` (e.g. a weight load aborted it) is sent again,
  with a fresh rid, at most `abort_retries` times, then `GenerationAborted`; it is never returned.
- A reply that is not one JSON result object (or misses/mistypes a field) is `GenerateRejected`
  naming the field.
- A returned result always carries `meta_info.weight_version == expected` and no span of another
  version, else `WeightVersionMismatch`.
- At most `max_concurrency` requests are in flight per `RouterGenerator` (asyncio.Semaphore).
- `forward(method, path, body, expected)` sends a caller's own body (`/generate`, `/v1/...`) under the
  same bound, 503 backoff and abort retries; a non-200 reply is returned as it came (status, JSON or
  text); a 200 reply must be JSON and name `expected` (`check_reply_version`), else
  `GenerateRejected` / `WeightVersionMismatch`. `expected=None` (e.g. `GET /v1/models`) checks none.
  `send=` (a `Sender`) carries the exchange instead of the httpx client (the point gateway's lean
  keep-alive client) to an `http://` router (an `https://` one keeps httpx); its transport failures
  (`OSError`) are `FleetError` as httpx's are.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from pydantic import ValidationError

from pinned_eval.fleet.engine_api import bearer
from pinned_eval.fleet.errors import FleetError, GenerateRejected, GenerationAborted, WeightVersionMismatch
from pinned_eval.fleet.models import GenerateResult, SamplingParams, normalize_url

Sender = Callable[[str, str, bytes | None, dict[str, str]], Awaitable[tuple[int, bytes]]]
"""`(method, url, JSON body bytes or None, headers) -> (status, reply bytes)`; raises `OSError`."""


def build_generate_body(
    prompt: str | None = None,
    *,
    input_ids: list[int] | None = None,
    sampling_params: SamplingParams | dict[str, Any] | None = None,
    rid: str | None = None,
    lora_path: str | None = None,
) -> dict[str, Any]:
    """The `/generate` JSON for one prompt (text or token ids), validated at the edge."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of `prompt` or `input_ids`")
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError("prompt: one string per request (the router rejects text batches)")
    if input_ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
        raise TypeError("input_ids: a flat list of ints (one prompt per request)")
    sp = (
        sampling_params
        if isinstance(sampling_params, SamplingParams)
        else SamplingParams.model_validate(sampling_params or {})
    )
    body: dict[str, Any] = {"text": prompt} if prompt is not None else {"input_ids": list(input_ids or [])}
    body["sampling_params"] = sp.to_wire()
    if rid is not None:
        body["rid"] = rid
    if lora_path is not None:
        body["lora_path"] = lora_path  # an adapter *name* (SGLang's semantics); the router passes it on
    return body


def check_version(result: GenerateResult, expected: str) -> None:
    """Raise unless every token of `result` came from weights labelled `expected`."""
    spans = [s.version for s in result.meta_info.weight_versions]
    if result.weight_version != expected or any(v != expected for v in spans):
        raise WeightVersionMismatch(expected, result.weight_version, spans)


def _versions(item: Any) -> tuple[str | None, list[str]]:
    """(weight_version, span versions) one reply object names: `meta_info` (/generate) or `metadata` (/v1)."""
    if not isinstance(item, dict):
        return None, []
    info = item.get("meta_info") if "meta_info" in item else item.get("metadata")
    if not isinstance(info, dict):
        return None, []
    spans = info.get("weight_versions") or []
    got = info.get("weight_version")
    return (got if isinstance(got, str) else None), [
        str(s.get("version")) if isinstance(s, dict) else str(s) for s in (spans if isinstance(spans, list) else [])
    ]


def check_reply_version(payload: Any, expected: str) -> str:
    """Raise `WeightVersionMismatch` unless every result of a raw 200 reply (one `/generate` object, a
    `/generate` batch list, or a `/v1` reply) names `expected` and no span of another version."""
    for item in payload if isinstance(payload, list) else [payload]:
        got, spans = _versions(item)
        if got != expected or any(v != expected for v in spans):
            raise WeightVersionMismatch(expected, got, spans)
    return expected


def reply_aborted(payload: Any) -> bool:
    """Whether a raw reply reports an `abort` finish (`meta_info.finish_reason.type` or a `/v1` choice's)."""
    for item in payload if isinstance(payload, list) else [payload]:
        if not isinstance(item, dict):
            continue
        meta = item.get("meta_info")
        reason = meta.get("finish_reason") if isinstance(meta, dict) else None
        if isinstance(reason, dict) and reason.get("type") == "abort":
            return True
        choices = item.get("choices")
        if isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") == "abort"
                                             for c in choices):
            return True
    return False


class RouterGenerator:
    """Sends `/generate` bodies to one router under a concurrency limit."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        router_url: str,
        *,
        api_key: str | None = None,
        max_concurrency: int = 32,
        abort_retries: int = 3,
        unavailable_retries: int = 5,
    ) -> None:
        self._http = http
        self.url = normalize_url(router_url)
        self._headers = bearer(api_key)
        self.max_concurrency = max_concurrency
        self._sem = asyncio.Semaphore(max_concurrency)
        self.abort_retries = abort_retries
        self.unavailable_retries = unavailable_retries

    def _parse(self, resp: httpx.Response, sent: int) -> GenerateResult:
        """The reply as one result; malformed (not JSON, not one object, a field missing or mistyped)
        is `GenerateRejected` naming the field."""
        try:
            payload = resp.json()
        except ValueError:
            raise GenerateRejected(self.url, 200, f"/generate reply is not JSON: {resp.text[:200]!r}") from None
        if not isinstance(payload, dict):
            raise GenerateRejected(self.url, 200, f"expected one result object: {resp.text[:300]}")
        try:
            return GenerateResult.model_validate({**payload, "attempts": sent})
        except ValidationError as exc:
            bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
            raise GenerateRejected(self.url, 200, f"/generate reply: {bad}") from None

    async def generate(self, body: dict[str, Any], expected_version: str) -> GenerateResult:
        body = dict(body)
        rid = body.get("rid")
        sent, aborts, unavailable, last_abort = 0, 0, 0, ""
        async with self._sem:
            while True:
                if rid is not None and sent:
                    body["rid"] = f"{rid}.retry{sent}"  # a fresh id: the aborted one may linger
                sent += 1
                try:
                    resp = await self._http.post(f"{self.url}/generate", json=body, headers=self._headers)
                except httpx.TransportError as exc:
                    raise FleetError(f"router {self.url} unreachable: {exc!r}") from exc
                if resp.status_code == 503 and unavailable < self.unavailable_retries:
                    unavailable += 1  # no healthy worker right now (health-check cycle): back off, ask again
                    await asyncio.sleep(min(0.5 * 2 ** (unavailable - 1), 4.0))
                    continue
                if resp.status_code != 200:
                    raise GenerateRejected(self.url, resp.status_code, resp.text)
                result = self._parse(resp, sent)
                if result.finish_type == "abort":
                    reason = result.meta_info.finish_reason
                    last_abort = (reason.message or "") if reason else ""
                    aborts += 1
                    if aborts > self.abort_retries:
                        raise GenerationAborted(rid, aborts, last_abort)
                    await asyncio.sleep(min(0.1 * aborts, 1.0))
                    continue
                check_version(result, expected_version)
                return result

    async def forward(
        self, method: str, path: str, body: dict[str, Any] | None, expected_version: str | None,
        *, send: Sender | None = None,
    ) -> tuple[int, Any]:
        """A caller's own request (see the module docstring): (status, parsed reply)."""
        body = dict(body) if body is not None else None
        rid = body.get("rid") if body is not None else None
        sent, aborts, unavailable = 0, 0, 0
        async with self._sem:
            while True:
                if isinstance(rid, str) and sent and body is not None:
                    body["rid"] = f"{rid}.retry{sent}"
                sent += 1
                status, raw = await self._exchange(method, path, body, send)
                if status == 503 and unavailable < self.unavailable_retries:
                    unavailable += 1
                    await asyncio.sleep(min(0.5 * 2 ** (unavailable - 1), 4.0))
                    continue
                try:
                    payload = json.loads(raw)
                except ValueError:
                    text = raw.decode("utf-8", "replace")
                    if status == 200:
                        raise GenerateRejected(self.url, 200, f"{path} reply is not JSON: {text[:200]!r}") from None
                    return status, text
                if status != 200 or expected_version is None:
                    return status, payload
                if reply_aborted(payload):
                    aborts += 1
                    if aborts > self.abort_retries:
                        raise GenerationAborted(rid if isinstance(rid, str) else None, aborts, f"{path} aborted")
                    await asyncio.sleep(min(0.1 * aborts, 1.0))
                    continue
                check_reply_version(payload, expected_version)
                return 200, payload

    async def _exchange(
        self, method: str, path: str, body: dict[str, Any] | None, send: Sender | None
    ) -> tuple[int, bytes]:
        """One request of `forward`: (status, reply bytes); a transport failure is `FleetError`."""
        content = None if body is None else json.dumps(
            body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        try:
            if send is not None and self.url.startswith("http://"):  # TLS stays with httpx
                return await send(method, f"{self.url}{path}", content, self._headers)
            headers = self._headers if content is None else {**self._headers, "Content-Type": "application/json"}
            resp = await self._http.request(method, f"{self.url}{path}", content=content, headers=headers)
            return resp.status_code, resp.content
        except (httpx.TransportError, OSError) as exc:
            raise FleetError(f"router {self.url} unreachable: {exc!r}") from exc

    @property
    def request_timeout_s(self) -> float | None:
        """The read timeout of the router client (a `send=` carrier uses the same)."""
        return self._http.timeout.read
