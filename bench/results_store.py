"""Results store: the cost of keeping samples, a cached rerun, and rescore vs regenerate.

On the demo-size point (the demo's suite: `arith_add` + `arith_sub`, 64 prompts each, greedy,
2 CPU engines behind sglang-router, a tiny model), through the real eval-point flow on a local
Prefect server, side by side in one run (repetitions alternate between the variants):

1. a point with no results store (`results_root` unset) vs the same point with one (first run:
   generations stored before scoring, samples written after) — whole point, and the Parquet
   writes alone (both files of the point, timed directly) as a share of the point's time;
2. a cached rerun of that point (same snapshot, suite and step: scored from the stored
   generations, no pin, no request) vs its first run;
3. `pinned-eval rescore` of the point (`app.commands.results.rescore_point`: stored generations,
   the suite's rewards, samples and JSONL rewritten; no fleet) vs regenerating it (a point with no
   store: pin, generate, score, log).

Workloads (`--workload`): `demo` is the demo's suite as it is (greedy, at most 4 new tokens
stopped at a newline: a generation of a few tokens, so the point is mostly flow overhead);
`long` is the same 128 prompts as an eval a user runs on a policy would generate: 4 samples per
prompt at temperature 0.8, up to `--max-new-tokens` (default 48) new tokens, no stop string (512
samples; the mean completion length is printed). The cache saves the generation, so its speed-up grows with it.

`python -m bench results_store [--reps N] [--workload demo|long] [--max-new-tokens N]`
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench results_store")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workload", choices=("demo", "long"), default="demo")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the long workload's cap")
    args = parser.parse_args(argv or [])
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from app.prefect_server import running_server

    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp) / "home"):
        results = _measure(Path(tmp), args.reps, _suite(args.workload, args.max_new_tokens))
    _print(results, args.reps, args.workload)


def _suite(workload: str, max_new_tokens: int):  # type: ignore[no-untyped-def]
    from pinned_eval.suite import default_suite

    suite = default_suite()
    if workload == "demo":
        return suite
    long = {"n_samples_per_prompt": 4, "temperature": 0.8, "max_new_tokens": max_new_tokens, "stop": ()}
    return suite.model_copy(update={"defaults": suite.defaults.model_copy(update=long)})


def _measure(root: Path, reps: int, suite_under_test: object) -> dict[str, list[float]]:
    import torch
    from safetensors.torch import load_file

    from app.commands.results import rescore_point
    from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
    from engine.tiny_model import make_tiny_model
    from flows.eval_point import eval_point
    from pinned_eval.fleet import launch_cpu_fleet
    from pinned_eval.results.store import GENERATIONS, SAMPLES
    from pinned_eval.snapshot.writer import write_snapshot

    base = make_tiny_model(root / "base", seed=0)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(shard))
    snapshot = root / "snapshot"
    write_snapshot(sorted(tensors.items()), str(snapshot), base_hf_dir=str(base))
    fleet = launch_cpu_fleet(base, 2, log_dir=root / "logs", state_file=root / "fleet.json")
    try:
        FleetBlock(name="bench", mode="launch", state_file=str(root / "fleet.json")).save("bench", overwrite=True)
        EvalSuiteBlock(suite=suite_under_test).save("bench", overwrite=True)
        staging = StagingBlock(root=str(root / "staging"), keep_snapshots=100, source_roots=[str(root)])
        staging.save("bench", overwrite=True)
        SinksBlock(jsonl_path=str(root / "plain.jsonl")).save("plain", overwrite=True)
        kept = SinksBlock(jsonl_path=str(root / "kept.jsonl"), results_root=str(root / "results"))
        kept.save("kept", overwrite=True)
        store = kept.results_store()
        assert store is not None
        suite = EvalSuiteBlock.load("bench")

        def point(step: int, sinks: str) -> float:
            dest = staging.staging().path_for("bench", step)
            if not Path(dest).exists():
                staging.staging().put(snapshot, "bench", step)
            t0 = time.perf_counter()
            state = eval_point(run="bench", step=step, source={"kind": "staged", "path": dest}, suite="bench",
                               fleet="bench", staging="bench", sinks=sinks, return_state=True)
            seconds = time.perf_counter() - t0
            assert state.name == "Completed", state.message
            return seconds

        point(0, "plain")  # warm-up: imports, first pin, first client
        out: dict[str, list[float]] = {k: [] for k in ("plain", "kept", "cached", "rescore", "writes")}
        for r in range(reps):
            out["plain"].append(point(10 * r + 1, "plain"))
            out["kept"].append(point(10 * r + 2, "kept"))
            out["cached"].append(point(10 * r + 2, "kept"))
            t0 = time.perf_counter()
            rescore_point("bench", 10 * r + 2, suite, kept)
            out["rescore"].append(time.perf_counter() - t0)
            gens, samples = store.read("bench", 10 * r + 2, GENERATIONS), store.read("bench", 10 * r + 2, SAMPLES)
            t0 = time.perf_counter()
            store.write("bench", 1000 + r, GENERATIONS, gens)
            store.write("bench", 1000 + r, SAMPLES, samples)
            out["writes"].append(time.perf_counter() - t0)
        out["rows"] = [float(samples.num_rows)]
        out["tokens"] = [statistics.mean(t or 0 for t in samples.column("completion_tokens").to_pylist())]
        return out
    finally:
        fleet.stop()


def _print(res: dict[str, list[float]], reps: int, workload: str) -> None:
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{workload} point: {int(med['rows'])} samples, {med['tokens']:.1f} completion tokens each on average; "
          f"medians of {reps} alternating repetitions (s)")
    print(f"{'measure':58} {'value':>10}")
    rows = [
        ("point, no results store (s)", med["plain"]),
        ("point, results store, first run (s)", med["kept"]),
        ("Parquet writes of the point: generations + samples (s)", med["writes"]),
        ("  share of the point's time (goal <= 5%)", med["writes"] / med["kept"]),
        ("whole-point ratio store / no store", med["kept"] / med["plain"]),
        ("cached rerun of the same point (s)", med["cached"]),
        ("  speed-up first run / cached rerun (goal >= 5x)", med["kept"] / med["cached"]),
        ("rescore (stored generations, no fleet) (s)", med["rescore"]),
        ("  speed-up regenerate (point, no store) / rescore", med["plain"] / med["rescore"]),
    ]
    for label, value in rows:
        print(f"{label:58} {value:10.3f}")
    print("per repetition (s): " + "; ".join(f"{k} " + " ".join(f"{v:.2f}" for v in res[k])
                                           for k in ("plain", "kept", "cached", "rescore")))
    print(f"\nload average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main(sys.argv[1:])
