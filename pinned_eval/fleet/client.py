"""Fleet client: pin every engine to one verified weight version, then generate through the router.

Contract:
- Control calls (load, read-back, pause) go to each engine directly; generation goes through the
  router, one prompt per request, with a per-fleet concurrency limit.
- `pin(path, version)`: make sure every engine is alive (reviving dead engines this fleet launched),
  load the snapshot on all engines in parallel, read back every engine; accept only when every
  engine loaded and reports both `weight_version == version` and `model_path == path`. Two attempts,
  then `PinViolation`; engines down and not revivable, or a router that never serves, raise
  `FleetUnhealthy`. On success the router's membership is exactly the verified engines.
- Health never calls a loading or paused engine dead (up / busy / dead as `pinned_eval.fleet.health`
  defines them, from what the engine answers and what this client has in flight).
- Weights are "unknown" on an engine from the start of a load until a pin verifies it, after a failed
  load and after a revival; such an engine is never registered with the router.
- `generate` retries `finish_reason.type == "abort"` (bounded) and raises `WeightVersionMismatch`
  when a response carries any version but the expected one (default: the last pinned version).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.fleet.engine_api import EngineAPI
from pinned_eval.fleet.errors import (
    FleetError,
    FleetUnhealthy,
    NotPinned,
    PinViolation,
)
from pinned_eval.fleet.generate import RouterGenerator, build_generate_body
from pinned_eval.fleet.health import EngineRecord, engine_health
from pinned_eval.fleet.lora import load_adapter, verify_adapter
from pinned_eval.fleet.models import (
    EngineCheck,
    EngineHealth,
    EngineInfo,
    GenerateResult,
    HealthState,
    LoadOutcome,
    PinResult,
    SamplingParams,
    normalize_path,
    normalize_url,
)
from pinned_eval.fleet.readback import judge_readback
from pinned_eval.fleet.router_api import RouterAPI
from pinned_eval.polling import PollTimeout, apoll_until

log = logging.getLogger(__name__)


class Reviver(Protocol):
    """What the client needs from a launcher to bring a dead engine back (blocking calls)."""

    def manages(self, url: str) -> bool: ...

    def revive(self, url: str) -> None: ...


class FleetConfig(BaseModel):
    """Timeouts, bounds and credentials of one fleet client."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    load_timeout_s: float = Field(default=600.0, gt=0, description="One weight load on one engine.")
    health_timeout_s: float = Field(default=30.0, gt=0, description="One /health probe (SGLang's own waits 20 s).")
    dead_after_s: float = Field(default=60.0, ge=0, description="A 503 with no load in flight this long = dead.")
    alive_timeout_s: float = Field(default=600.0, gt=0, description="Wait for busy engines before a pin.")
    poll_interval_s: float = Field(default=1.0, gt=0)
    pin_attempts: int = Field(default=2, ge=1)
    router_ready_timeout_s: float = Field(default=180.0, gt=0)
    worker_timeout_s: float = Field(default=60.0, gt=0, description="Router add/remove of one worker.")
    max_concurrency: int = Field(default=32, ge=1, description="Most /generate requests in flight.")
    request_timeout_s: float = Field(default=600.0, gt=0, description="One /generate request.")
    abort_retries: int = Field(default=3, ge=0, description="Retries of a request that came back aborted.")
    unavailable_retries: int = Field(default=5, ge=0, description="Retries of a router 503 (no healthy worker).")
    api_key: str | None = Field(default=None, repr=False, description="Data-plane bearer token.")
    admin_api_key: str | None = Field(default=None, repr=False, description="Control-plane bearer token.")


class FleetClient:
    """Async client for N SGLang-protocol engines behind one sglang-router. Use `async with`."""

    def __init__(
        self,
        engine_urls: list[str],
        router_url: str | None = None,
        *,
        config: FleetConfig | None = None,
        reviver: Reviver | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not engine_urls:
            raise ValueError("engine_urls: a fleet needs at least one engine")
        self.config = config or FleetConfig()
        self._engines = {normalize_url(u): EngineRecord(normalize_url(u)) for u in engine_urls}
        self._reviver = reviver
        self._control = httpx.AsyncClient(transport=transport, timeout=self.config.load_timeout_s)
        limits = httpx.Limits(
            max_connections=self.config.max_concurrency + 4,
            max_keepalive_connections=self.config.max_concurrency,
        )
        self._data = httpx.AsyncClient(transport=transport, timeout=self.config.request_timeout_s, limits=limits)
        self.engines = EngineAPI(
            self._control,
            api_key=self.config.api_key,
            admin_api_key=self.config.admin_api_key,
            load_timeout_s=self.config.load_timeout_s,
            health_timeout_s=self.config.health_timeout_s,
        )
        self.router = (
            RouterAPI(self._control, router_url, api_key=self.config.api_key) if router_url is not None else None
        )
        self._generator = (
            RouterGenerator(
                self._data,
                router_url,
                api_key=self.config.api_key,
                max_concurrency=self.config.max_concurrency,
                abort_retries=self.config.abort_retries,
                unavailable_retries=self.config.unavailable_retries,
            )
            if router_url is not None
            else None
        )
        self._pinned: str | None = None

    async def __aenter__(self) -> FleetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._data.aclose()
        await self._control.aclose()

    @property
    def engine_urls(self) -> list[str]:
        return list(self._engines)

    @property
    def pinned_version(self) -> str | None:
        """The version the last successful pin verified; None before it or after a failed pin."""
        return self._pinned

    # ---- probe and health --------------------------------------------------------------

    async def probe(self, url: str) -> EngineInfo:
        """`GET /model_info` (falling back to `/get_model_info`) of one engine."""
        return await self.engines.model_info(url)

    async def health(self, url: str) -> EngineHealth:
        """Classify one engine as up, busy or dead (`pinned_eval.fleet.health`)."""
        return await engine_health(self.engines, self._engines[normalize_url(url)], self.config.dead_after_s)

    async def fleet_health(self) -> list[EngineHealth]:
        return list(await asyncio.gather(*(self.health(u) for u in self._engines)))

    async def ensure_alive(self) -> list[str]:
        """Wait until every engine is up or can take a load, reviving dead launched ones once each.

        Returns the revived URLs. Busy engines get `alive_timeout_s`; then `FleetUnhealthy`.
        """
        revived: list[str] = []
        busy: list[EngineHealth] = []

        async def all_up() -> bool:
            nonlocal busy
            while True:  # revive the dead ones (once each), then look again at once
                views = await self.fleet_health()
                dead = [v for v in views if v.state is HealthState.DEAD]
                for view in dead:
                    if view.url in revived:
                        raise FleetUnhealthy(f"{view.url} is dead again after a revival: {view.detail}", [view.url])
                    await self.revive(view.url, reason=view.detail)
                    revived.append(view.url)
                if not dead:
                    break
            busy = [v for v in views if v.state is HealthState.BUSY and not v.loadable]
            return not busy

        try:
            await apoll_until(
                all_up, timeout_s=self.config.alive_timeout_s, interval_s=self.config.poll_interval_s, what=""
            )
        except PollTimeout:
            detail = "; ".join(f"{v.url}: {v.detail}" for v in busy)
            raise FleetUnhealthy(
                f"engines not up after {self.config.alive_timeout_s}s: {detail}", [v.url for v in busy]
            ) from None
        return revived

    async def revive(self, url: str, *, reason: str = "asked") -> None:
        """Relaunch a launched engine (same args and port); it must be pinned again before use."""
        rec = self._engines[normalize_url(url)]
        if self._reviver is None or not self._reviver.manages(rec.url):
            raise FleetUnhealthy(f"{rec.url} is down ({reason}) and was not launched by this fleet", [rec.url])
        log.warning("reviving %s (%s)", rec.url, reason)
        rec.weights_known, rec.verified_version = False, None
        if self.router is not None:
            await self._router_call(self.router.remove_worker(rec.url, timeout_s=self.config.worker_timeout_s))
        try:
            await asyncio.to_thread(self._reviver.revive, rec.url)
        except (OSError, RuntimeError, TimeoutError) as exc:
            raise FleetUnhealthy(f"reviving {rec.url} failed: {exc}", [rec.url]) from exc
        rec.unhealthy_since = None

    # ---- pin ---------------------------------------------------------------------------

    async def pin(
        self,
        snapshot_path: str | Path,
        weight_version: str | int,
        *,
        lora_base: str | Path | None = None,
        on_attempt: Callable[[int, list[EngineCheck]], None] | None = None,
    ) -> PinResult:
        """Load `snapshot_path` as `weight_version` on every engine and verify every engine;
        `on_attempt(attempt, checks)` sees every attempt's verdicts (the one pin-and-read-back,
        also used by the external posture's reference backend).

        With `lora_base`, `snapshot_path` is a LoRA adapter served on top of the base weights at
        `lora_base` (adapter mode, `pinned_eval.fleet.lora`); generate then names it (`lora_path`).
        """
        path, version = normalize_path(snapshot_path), str(weight_version)
        base = normalize_path(lora_base) if lora_base is not None else None
        started = time.monotonic()
        self._pinned = None
        revived: list[str] = []
        checks: list[EngineCheck] = []
        for attempt in range(1, self.config.pin_attempts + 1):
            revived += await self.ensure_alive()
            loads = await asyncio.gather(*(self._load(u, path, version, base) for u in self._engines))
            checks = list(await asyncio.gather(*(self._verify(ld, path, version, base) for ld in loads)))
            if on_attempt is not None:
                on_attempt(attempt, checks)
            if all(c.ok for c in checks):
                break
            log.warning(
                "pin %s attempt %d/%d failed: %s",
                version,
                attempt,
                self.config.pin_attempts,
                "; ".join(f"{c.url}: {c.problem}" for c in checks if not c.ok),
            )
        else:
            await self._evict([c.url for c in checks if not c.ok])
            raise PinViolation(version, path, checks, self.config.pin_attempts)
        for check in checks:
            rec = self._engines[check.url]
            rec.weights_known, rec.verified_version = True, version
        members: list[str] = []
        if self.router is not None:
            members = await self._router_call(
                self.router.sync_workers(list(self._engines), timeout_s=self.config.worker_timeout_s)
            )
            await self._router_call(self.router.wait_ready(timeout_s=self.config.router_ready_timeout_s))
        self._pinned = version
        infos = [EngineInfo(url=c.url, weight_version=c.weight_version, model_path=c.model_path or "") for c in checks]
        return PinResult(
            snapshot_path=path,
            weight_version=version,
            engines=infos,
            attempts=attempt,
            revived=revived,
            router_workers=members,
            duration_s=time.monotonic() - started,
        )

    async def _load(self, url: str, path: str, version: str, base: str | None = None) -> LoadOutcome:
        rec = self._engines[url]
        known_good = rec.weights_known
        rec.loading, rec.weights_known, rec.verified_version = True, False, None
        try:
            if base is not None:
                return await load_adapter(self.engines, url, path, version, base, base_known_good=known_good)
            return await self.engines.load(url, path, version)
        finally:
            rec.loading = False
            rec.unhealthy_since = None

    async def _verify(self, load: LoadOutcome, path: str, version: str, base: str | None = None) -> EngineCheck:
        if base is not None:
            return await verify_adapter(self.engines, load, path, version, base)
        try:
            info = await self.engines.model_info(load.url)
        except (httpx.TransportError, FleetError) as exc:
            return judge_readback(load, version=version, path=path, read_error=repr(exc))
        return judge_readback(
            load,
            version=version,
            path=path,
            got_version=info.weight_version,
            got_path=normalize_path(info.model_path) if info.model_path else None,
        )

    async def _evict(self, urls: list[str]) -> None:
        """Take engines with unverified weights out of the router (best effort: the pin failed anyway)."""
        if self.router is None:
            return
        for url in urls:
            try:
                await self.router.remove_worker(url, timeout_s=self.config.worker_timeout_s)
            except (httpx.TransportError, FleetError) as exc:
                log.warning("could not remove %s from the router after a failed pin: %r", url, exc)

    async def _router_call(self, call: Any) -> Any:
        """Await a router call; a router that cannot be reached or does not comply is an unhealthy fleet."""
        try:
            return await call
        except (httpx.TransportError, FleetError) as exc:
            raise FleetUnhealthy(f"router: {exc}") from exc

    # ---- pause (so health knows) -------------------------------------------------------

    async def pause_generation(self, mode: Literal["abort", "retract", "in_place"] = "abort") -> None:
        """Pause every engine; health reports them busy, not dead, until `continue_generation`."""
        for rec in self._engines.values():
            rec.paused = True
        await asyncio.gather(*(self.engines.pause(u, mode) for u in self._engines))

    async def continue_generation(self) -> None:
        await asyncio.gather(*(self.engines.resume(u) for u in self._engines))
        for rec in self._engines.values():
            rec.paused, rec.unhealthy_since = False, None

    # ---- generate ----------------------------------------------------------------------

    @property
    def generator(self) -> RouterGenerator:
        """The router client every `/generate` of this fleet goes through (`pinned_eval.rollout`'s
        point session wraps it); `FleetError` without a router_url."""
        if self._generator is None:
            raise FleetError("generate needs a router_url")
        return self._generator

    async def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
        expected_version: str | None = None,
        lora_path: str | None = None,
    ) -> GenerateResult:
        """One sample through the router, retried while aborted, checked against the pinned version.

        `lora_path` names the adapter to generate with (adapter mode: the pinned weight version)."""
        expected = expected_version if expected_version is not None else self._pinned
        if expected is None:
            raise NotPinned("no successful pin and no expected_version: refusing to generate unverified")
        if self._generator is None:
            raise FleetError("generate needs a router_url")
        body = build_generate_body(
            prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid, lora_path=lora_path
        )
        return await self._generator.generate(body, expected)
