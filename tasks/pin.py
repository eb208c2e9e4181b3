"""Pin tasks: put one verified weight version on every engine of a fleet (or verify it, shared).

Contract: `pin_fleet` returns only when every engine reports `weight_version == str(step)` and
`model_path == snapshot dir`, and the router serves exactly those engines; otherwise it raises
`EvalSkipped` (`pin_violation` after 2 attempts, `unhealthy` when engines are down and cannot be
revived or the router never serves). In adapter mode (`lora_base`) the engines keep the base and
load the adapter as `lora_name == str(step)`; the read-back also requires that adapter, alone, on
every engine. `verify_shared` loads nothing: every training engine must
already report the expected version (shared posture). The caller holds the fleet lock.
"""

from __future__ import annotations

import asyncio

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from blocks.fleet import FleetBlock
from pinned_eval.fleet.models import PinResult
from pinned_eval.prometheus import pin_timed
from pinned_eval.skip_mapping import fleet_skips
from pinned_eval.skips import EvalSkipped, SkipReason


@task(cache_policy=NO_CACHE, task_run_name="pin-{weight_version}")
def pin_fleet(fleet: FleetBlock, snapshot_dir: str, weight_version: str, lora_base: str | None = None) -> PinResult:
    """`lora_base`: `snapshot_dir` is a LoRA adapter to serve over that base (adapter mode)."""

    async def pin() -> PinResult:
        async with fleet.client() as client:
            return await client.pin(snapshot_dir, weight_version, lora_base=lora_base)

    with fleet_skips(f"fleet {fleet.name}"):  # router/transport trouble the client could not classify
        result = asyncio.run(pin())
    pin_timed(fleet.name, result.duration_s)
    get_run_logger().info(
        "pinned %d engines to %s in %.1fs (attempts %d, revived %s)",
        len(result.engines),
        weight_version,
        result.duration_s,
        result.attempts,
        result.revived or "none",
    )
    return result


@task(cache_policy=NO_CACHE, task_run_name="verify-shared-{weight_version}")
def verify_shared(fleet: FleetBlock, weight_version: str) -> list[str]:
    """Every engine must report `weight_version` already; returns the engine URLs."""

    async def versions() -> dict[str, str | None]:
        async with fleet.client() as client:
            infos = await asyncio.gather(*(client.probe(u) for u in client.engine_urls))
            return {i.url: i.weight_version for i in infos}

    with fleet_skips(f"fleet {fleet.name}"):
        seen = asyncio.run(versions())
    wrong = {u: v for u, v in seen.items() if v != weight_version}
    if wrong:
        raise EvalSkipped(SkipReason.PIN_VIOLATION, f"expected version {weight_version}, engines report {wrong}")
    return list(seen)
