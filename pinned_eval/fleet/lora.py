"""Adapter-mode pin steps: the engines keep the base weights and serve one LoRA adapter per point.

Contract (used by `FleetClient.pin(..., lora_base=...)`, one engine at a time, in parallel):
- `load_adapter`: if the engine does not serve `base` (its `/model_info` `model_path` differs, or
  its weights are not known good), load `base` first with `/update_weights_from_disk`; unload every
  adapter it has loaded (`/unload_lora_adapter`, the previous point's included); load the adapter
  with `/load_lora_adapter` (`lora_name` = the weight version, `lora_path` = the adapter dir); then
  label the engine with `/update_weight_version` (no aborts: the caller holds the fleet lock), so
  every response of this point carries the adapter's version.
- `verify_adapter`: the read-back accepts an engine only when `/model_info` reports the version and
  `model_path == base`, and `/v1/models` lists exactly one adapter, named the version, whose path
  is the adapter dir. Generation then names the adapter in every request (`lora_path`).
"""

from __future__ import annotations

from functools import partial

import httpx

from pinned_eval.fleet.engine_api import EngineAPI
from pinned_eval.fleet.errors import FleetError
from pinned_eval.fleet.models import EngineCheck, LoadOutcome, normalize_path
from pinned_eval.fleet.readback import judge_readback


async def load_adapter(
    api: EngineAPI, url: str, adapter: str, version: str, base: str, *, base_known_good: bool
) -> LoadOutcome:
    """Base (if needed), unload old adapters, load this one, label the version; never raises."""
    try:
        served = normalize_path((await api.model_info(url)).model_path)
        if served != base or not base_known_good:
            loaded = await api.load(url, base, version)
            if not loaded.ok:
                return loaded.model_copy(update={"message": f"base {base}: {loaded.message}"})
        for name in await api.lora_adapters(url):
            unloaded = await api.unload_lora(url, name)
            if not unloaded.ok:
                return unloaded.model_copy(update={"message": f"unloading adapter {name!r}: {unloaded.message}"})
        outcome = await api.load_lora(url, version, adapter)
        if outcome.ok:
            await api.set_weight_version(url, version, abort_all_requests=False)
        return outcome
    except httpx.TimeoutException as exc:
        return LoadOutcome(url=url, ok=False, message=repr(exc), error="timeout")
    except httpx.TransportError as exc:
        return LoadOutcome(url=url, ok=False, message=repr(exc), error="connection")
    except FleetError as exc:
        return LoadOutcome(url=url, ok=False, message=str(exc), error="http")


async def verify_adapter(api: EngineAPI, load: LoadOutcome, adapter: str, version: str, base: str) -> EngineCheck:
    """Read back `/model_info` and `/v1/models` of one engine and judge them (see the module contract)."""
    judge = partial(
        judge_readback, load, version=version, path=base, load_label="adapter load", path_label="base model_path"
    )
    try:
        info = await api.model_info(load.url)
        adapters = await api.lora_adapters(load.url)
    except (httpx.TransportError, FleetError) as exc:
        return judge(read_error=repr(exc))
    extra = []
    if adapters != {version: adapter}:
        extra.append(f"loaded adapters {str(adapters)[:300]}, expected only {version!r} from {adapter}")
    return judge(got_version=info.weight_version, got_path=normalize_path(info.model_path), extra_problems=extra)
