"""CPU engine: continuous batching vs one-request-at-a-time, and in-place weight loads.

Side by side in one run, on tiny offline models (no downloads):
- decode throughput of N concurrent greedy requests (one shared batch) vs the same N requests
  sent one after another, in process (`Runner`) and over HTTP (a real `pinned-eval engine serve`);
- `update_weights_from_disk` of a snapshot in place vs `from_pretrained` of the same snapshot.
Ratios are time(serial or reference) / time(batched or engine path): > 1 means the engine is faster.
"""

from __future__ import annotations

import socket
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

N_REQUESTS = 16
NEW_TOKENS = 64


def _runner_pair(model_dir: Path) -> tuple[float, float]:
    from engine.batch import Sequence
    from engine.protocol import SamplingParams
    from engine.runner import Runner

    runner = Runner(str(model_dir), "bench")
    runner.start()
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)

    def seqs() -> list[Sequence]:
        return [
            Sequence(rid=f"r{i}", prompt_ids=[1, 5 + i, 6], params=params, seed=0) for i in range(N_REQUESTS)
        ]

    try:
        t0 = time.perf_counter()
        for seq in seqs():
            runner.submit([seq])
            seq.future.result()
        serial = time.perf_counter() - t0
        batch = seqs()
        t0 = time.perf_counter()
        runner.submit(batch)
        for seq in batch:
            seq.future.result()
        batched = time.perf_counter() - t0
    finally:
        runner.stop()
    return serial, batched


def _http_pair(model_dir: Path, log_dir: Path) -> tuple[float, float]:
    import httpx

    from pinned_eval.fleet.cpu_engine import CpuEngineArgs, spawn_engine

    with socket.socket() as s:  # a free port on loopback, picked by the OS
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = spawn_engine(CpuEngineArgs(model_path=str(model_dir), port=port), log_dir / "engine.log")
    try:
        proc.wait_ready(timeout=180)
        body = {"input_ids": [1, 5, 6], "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                                                "ignore_eos": True}}
        with httpx.Client(base_url=proc.url, timeout=300) as client:
            client.post("/generate", json=body)  # warm-up
            t0 = time.perf_counter()
            for _ in range(N_REQUESTS):
                client.post("/generate", json=body).raise_for_status()
            serial = time.perf_counter() - t0
            t0 = time.perf_counter()
            with ThreadPoolExecutor(N_REQUESTS) as pool:
                for r in pool.map(lambda _: client.post("/generate", json=body), range(N_REQUESTS)):
                    r.raise_for_status()
            batched = time.perf_counter() - t0
    finally:
        proc.stop()
    return serial, batched


def _load_pair(model_dir: Path, other: Path) -> tuple[float, float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.weights import load_into, weight_files

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    size = sum(p.stat().st_size for p in weight_files(other))
    inplace, fresh = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        load_into(model, other)
        inplace.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
        fresh.append(time.perf_counter() - t0)
    return statistics.median(fresh), statistics.median(inplace), size


def main() -> None:
    from transformers.utils import logging as hf_logging

    from engine.tiny_model import make_tiny_model, perturb_snapshot

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny = make_tiny_model(root / "tiny")
        wide = make_tiny_model(root / "wide", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4)
        wide_b = perturb_snapshot(wide, root / "wide-b", seed=1)
        rows = []
        for name, model in (("tiny (115K params)", tiny), ("wide (hidden 512, 8 layers)", wide)):
            serial, batched = _runner_pair(model)
            rows.append((f"{N_REQUESTS}x{NEW_TOKENS} tokens, Runner, {name}", serial, batched))
        serial, batched = _http_pair(tiny, root)
        rows.append((f"{N_REQUESTS}x{NEW_TOKENS} tokens, HTTP engine process, tiny", serial, batched))
        fresh, inplace, size = _load_pair(wide, wide_b)
    print(f"{'case':<58} {'serial s':>9} {'batched s':>10} {'tok/s batched':>14} {'ratio':>6}")
    for case, serial, batched in rows:
        tps = N_REQUESTS * NEW_TOKENS / batched
        print(f"{case:<58} {serial:>9.3f} {batched:>10.3f} {tps:>14.0f} {serial / batched:>6.2f}")
    print(f"\n{'weight load of ' + format(size / 2**20, '.0f') + ' MiB snapshot':<58} {'from_pretrained s':>18}"
          f" {'in place s':>11} {'ratio':>6}")
    print(f"{'wide model, fp32, median of 3':<58} {fresh:>18.3f} {inplace:>11.3f} {fresh / inplace:>6.2f}")


if __name__ == "__main__":
    main()
