"""LoRA adapter-mode pin vs full-snapshot pin on the same model (CPU fleet behind sglang-router).

Side by side in one run: 2 CPU engines on a "wide" tiny model (hidden 512, 8 layers, fp32);
- full pin: `/update_weights_from_disk` of a full snapshot (the adapter merged into the base, as
  merged mode pins it) on every engine + read-back + router sync;
- adapter pin: the engines keep the base; unload the previous adapter, `/load_lora_adapter` the new
  one (rank 16 on q/v/o/down), relabel, read back `/model_info` + `/v1/models`, router sync;
- the export each mode needs: a full snapshot written by `write_snapshot` (merged mode writes one
  too, `export_merged`) vs the adapter snapshot (`write_adapter_snapshot`).
Medians of REPEATS pins alternating two snapshots (first pin of each mode not counted), and of the
engine-side load step alone (one engine, direct HTTP);
ratio = full / adapter (> 1: adapter mode is faster).
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import tempfile
import time
from pathlib import Path

REPEATS = 5
ENGINES = 2
KEY = secrets.token_urlsafe(32)  # the bench fleet's API and admin key (one value: one header for both planes)
AUTH = {"Authorization": f"Bearer {KEY}"}


async def _pins(urls: list[str], router: str, snaps: list[str], base: str | None) -> list[float]:
    from pinned_eval.fleet import FleetClient, FleetConfig

    times = []
    config = FleetConfig(router_ready_timeout_s=120, api_key=KEY, admin_api_key=KEY)
    async with FleetClient(urls, router, config=config) as client:
        for i in range(REPEATS + 1):
            t0 = time.perf_counter()
            await client.pin(snaps[i % 2], str(100 + i), lora_base=base)
            if i:  # the first pin of a mode also (re)loads the base: not counted
                times.append(time.perf_counter() - t0)
    return times


def _loads(url: str, fulls: list[str], adapters: list[str]) -> tuple[float, float]:
    """Median engine-side load alone: `/update_weights_from_disk` vs unload + `/load_lora_adapter`."""
    import httpx

    full, adapter = [], []
    with httpx.Client(base_url=url, timeout=300, headers=AUTH) as http:
        for i in range(REPEATS):
            t0 = time.perf_counter()
            http.post("/update_weights_from_disk", json={"model_path": fulls[i % 2]}).raise_for_status()
            full.append(time.perf_counter() - t0)
        for i in range(REPEATS):
            t0 = time.perf_counter()
            for card in http.get("/v1/models").json()["data"][1:]:
                http.post("/unload_lora_adapter", json={"lora_name": card["id"]}).raise_for_status()
            body = {"lora_name": f"l{i}", "lora_path": adapters[i % 2]}
            http.post("/load_lora_adapter", json=body).raise_for_status()
            adapter.append(time.perf_counter() - t0)
    return statistics.median(full), statistics.median(adapter)


def _size(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def main() -> None:
    from transformers.utils import logging as hf_logging

    from engine.tiny_model import make_tiny_adapter, make_tiny_model
    from pinned_eval.fleet import launch_cpu_fleet
    from pinned_eval.snapshot.lora import export_merged, write_adapter_snapshot

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny_model(root / "base", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4)
        adapters = [make_tiny_adapter(base, root / f"a{i}", seed=i, r=16) for i in (1, 2)]
        t0 = time.perf_counter()
        staged = [write_adapter_snapshot(a, str(root / f"step_a{i}")) for i, a in enumerate(adapters)]
        adapter_export = (time.perf_counter() - t0) / 2
        t0 = time.perf_counter()
        merged = [export_merged(a, base, str(root / f"step_m{i}")) for i, a in enumerate(adapters)]
        merged_export = (time.perf_counter() - t0) / 2
        fleet = launch_cpu_fleet(base, ENGINES, log_dir=root / "logs", api_key=KEY, admin_api_key=KEY,
                                 ready_timeout_s=300)
        try:
            assert fleet.router_url is not None
            full = asyncio.run(_pins(fleet.engine_urls, fleet.router_url, merged, None))
            adapter = asyncio.run(_pins(fleet.engine_urls, fleet.router_url, staged, str(base)))
            load_full, load_adapter = _loads(fleet.engine_urls[0], merged, staged)
        finally:
            fleet.stop()
        full_bytes, adapter_bytes = _size(merged[0]), _size(staged[0])
    f, a = statistics.median(full), statistics.median(adapter)
    print(f"{'case (2 CPU engines, hidden 512, 8 layers, LoRA r=16)':<58} {'full s':>8} {'adapter s':>10} {'ratio':>6}")
    print(f"{f'pin, median of {REPEATS}':<58} {f:>8.3f} {a:>10.3f} {f / a:>6.1f}")
    print(f"{'one engine, load step alone, median of ' + str(REPEATS):<58} {load_full:>8.3f} {load_adapter:>10.3f}"
          f" {load_full / load_adapter:>6.1f}")
    print(f"{'export (merged full snapshot vs adapter snapshot)':<58} {merged_export:>8.3f} {adapter_export:>10.3f}"
          f" {merged_export / adapter_export:>6.1f}")
    print(f"{'snapshot MiB':<58} {full_bytes / 2**20:>8.1f} {adapter_bytes / 2**20:>10.2f}"
          f" {full_bytes / adapter_bytes:>6.1f}")


if __name__ == "__main__":
    main()
