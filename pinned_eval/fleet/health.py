"""Health of one engine as a fleet client sees it: what the engine answers, joined with what the
client knows of it (`EngineRecord`: a load or pause in flight, weights known or not).

Contract (`engine_health`):
- Never calls a loading or paused engine dead: a 503 is "busy" while the client has a load or pause
  in flight, and otherwise until `dead_after_s` has passed with the 503 persisting. Only connection
  refused, or that persisting 503, is "dead".
- An engine whose weights are unknown and answers 503 while `/model_info` answers is busy but
  loadable (the next load heals it), not dead; a later client learns it from the engine when the
  engine reports it (`weights_ok` false).
- Any `/health` status but 200 and 503 is an auth or protocol problem: `FleetError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from pinned_eval.fleet.engine_api import EngineAPI
from pinned_eval.fleet.errors import FleetError
from pinned_eval.fleet.models import EngineHealth, HealthState


@dataclass
class EngineRecord:
    """What the client knows of one engine beyond what the engine says (one per engine, owned and
    updated by its `FleetClient`)."""

    url: str
    loading: bool = False
    paused: bool = False
    weights_known: bool = True  # the engine serves what it booted with, until we load something
    verified_version: str | None = None
    unhealthy_since: float | None = None


async def engine_health(api: EngineAPI, rec: EngineRecord, dead_after_s: float) -> EngineHealth:
    """Classify one engine as up, busy or dead (see the module contract); updates `rec`'s
    `unhealthy_since`, and forgets its weights when the engine needs a load."""
    if rec.loading or rec.paused:
        # /health would generate, and waits behind the load or the pause: ask /model_info instead.
        why = "loading" if rec.loading else "paused"
        try:
            await api.model_info(rec.url)
        except httpx.TimeoutException:
            return _view(rec, HealthState.BUSY, f"{why}; /model_info timed out")
        except httpx.TransportError as exc:
            return _view(rec, HealthState.DEAD, f"{why} but unreachable: {exc!r}")
        return _view(rec, HealthState.BUSY, why, loadable=rec.paused)  # a paused engine loads at once
    try:
        status = await _health_status(api, rec.url)
    except httpx.TimeoutException:
        status = 503  # SGLang answers 503 after its own 20 s; a slower silence is the same thing
    except httpx.TransportError as exc:
        return _view(rec, HealthState.DEAD, f"unreachable: {exc!r}")
    if status == 200:
        rec.unhealthy_since = None
        return _view(rec, HealthState.UP, "ok", status, loadable=True)
    if status != 503:
        raise FleetError(f"{rec.url}/health answered HTTP {status} (auth or protocol problem)")
    now = time.monotonic()
    rec.unhealthy_since = rec.unhealthy_since or now
    persisted = now - rec.unhealthy_since
    if persisted >= dead_after_s and rec.weights_known:
        return _view(rec, HealthState.DEAD, f"503 for {persisted:.0f}s with no load in flight", status)
    try:
        await api.model_info(rec.url)
    except httpx.ConnectError as exc:
        return _view(rec, HealthState.DEAD, f"503 then unreachable: {exc!r}", status)
    except (httpx.TransportError, FleetError) as exc:
        return _view(rec, HealthState.BUSY, f"503; /model_info failed too: {exc!r}", status)
    if not rec.weights_known or await _reports_weights_unknown(api, rec.url):
        # An engine may refuse to serve unknown weights (the bundled CPU engine does): a load heals it.
        rec.weights_known, rec.verified_version = False, None
        return _view(rec, HealthState.BUSY, "503 with weights unknown; needs a load", status, loadable=True)
    return _view(rec, HealthState.BUSY, f"503 for {persisted:.0f}s; /model_info answers", status)


async def _reports_weights_unknown(api: EngineAPI, url: str) -> bool:
    """The engine itself says its weights are unknown after a failed load (the bundled CPU engine's
    `/server_info` `internal_states[0].weights_ok`; SGLang has no such flag), so a client that did
    not see the failed load (a later point's) reloads it instead of waiting `dead_after_s`."""
    try:
        info = await api.server_info(url)
    except (httpx.TransportError, FleetError, ValueError):  # ValueError: not JSON
        return False
    states = info.get("internal_states")
    return (
        bool(states)
        and isinstance(states, list)
        and isinstance(states[0], dict)
        and (states[0].get("weights_ok") is False)
    )


async def _health_status(api: EngineAPI, url: str) -> int:
    """`/health` status; a dropped connection (not a refused one) is asked again once on a new one."""
    try:
        return await api.health(url)
    except (httpx.ConnectError, httpx.TimeoutException):
        raise
    except httpx.TransportError:
        return await api.health(url)


def _view(
    rec: EngineRecord, state: HealthState, detail: str, status: int | None = None, *, loadable: bool = False
) -> EngineHealth:
    return EngineHealth(
        url=rec.url,
        state=state,
        detail=detail,
        status_code=status,
        loadable=loadable,
        weights_known=rec.weights_known,
        verified_version=rec.verified_version,
    )
