"""An lm-eval harness point's overhead against running lm-eval directly on the same CPU engines.

2 CPU engines (tiny model) behind the real sglang-router; the repo's two local lm-eval tasks
(tests/data/lm_eval_tasks: 24 generation documents, 24 four-way multiple-choice documents, so
24 + 96 requests) run two ways:
- `direct`: lm-eval's own `simple_evaluate` in a fresh Python process against the router
  (`local-completions`, text prompts, the same `num_concurrent`), as a user would run it;
- `point`: the point's `lm_eval` rollout through `run_rollouts` on a `PointSession` (the point's
  gateway, version check and budget on every call, the lm-eval child process, the samples built
  from lm-eval's per-sample log) plus the metrics the score task adds (`lm_eval_metrics`).
Both pay lm-eval's import and task loading; the difference is the harness's overhead. Runs
alternate (direct, point, direct, ...) so they share the load of the moment; the first pair warms
up. Each point's metrics are checked equal to the direct run's. The overhead is split into the
child's part (its wall time minus the direct run's: the gateway hop on each request) and the part
around it (the gateway's start, reading lm-eval's result, building the samples, the metrics).

Usage: `python -m bench harness [--points N] [--concurrency N]` (defaults 3, 4).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.agentic_point import _free_port
from pinned_eval.datasets.loader import load_dataset
from pinned_eval.fleet.cpu_engine import CpuEngineArgs, engine_spec
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.fleet.keys import FleetKeys
from pinned_eval.fleet.launcher import LaunchedFleet, launch_fleet
from pinned_eval.rollout import ROLLOUTS, PointSession, run_rollouts
from pinned_eval.rollout.lm_eval import lm_eval_metrics, model_args
from pinned_eval.suite import DatasetSpec, EvalSuite

TASKS = Path(__file__).parent.parent / "tests" / "data" / "lm_eval_tasks"
TASK_NAMES = ["pe_arith_gen", "pe_colour_mc"]
DIRECT = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
req = json.loads(sys.argv[1])
out = simple_evaluate(model="local-completions", model_args=req["model_args"], tasks=req["tasks"],
                      task_manager=TaskManager(include_path=".", include_defaults=False), log_samples=True)
print(json.dumps(out["results"]))
"""


def start_fleet(base: Path, concurrency: int) -> tuple[LaunchedFleet, Path]:
    from engine.tiny_model import make_tiny_model

    model = make_tiny_model(base / "m", arch="llama", seed=0, chat_template="chatml")
    keys = FleetKeys.resolve()
    specs = [engine_spec(CpuEngineArgs(model_path=str(model), port=_free_port(), weight_version="1",
                                       api_key=keys.api, admin_api_key=keys.admin),
                         env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}) for _ in range(2)]
    return launch_fleet(specs, log_dir=base / "logs", keys=keys, ready_timeout_s=180), model


def direct(fleet: LaunchedFleet, model: Path, concurrency: int, cache: Path) -> tuple[float, dict[str, float]]:
    assert fleet.router_url is not None and fleet.keys is not None
    args = model_args("local-completions", fleet.router_url, str(model), concurrency)
    env = {**os.environ, "OPENAI_API_KEY": fleet.keys.api, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", DIRECT, json.dumps({"model_args": args, "tasks": TASK_NAMES})],
                          cwd=TASKS, env=env, capture_output=True, text=True, timeout=600, check=True)
    elapsed = time.perf_counter() - t0
    results = json.loads(done.stdout.strip().splitlines()[-1])
    flat = {f"eval/{t}/{k.partition(',')[0]}": float(v) for t, r in results.items() for k, v in r.items()
            if "," in k and isinstance(v, int | float)}
    return elapsed, flat


CHILD: list[float] = []  # the lm-eval child's wall time per point (timed around `LmEvalRollout._child`)


def _time_the_child() -> None:
    rollout = ROLLOUTS["lm_eval"]
    inner = rollout._child  # type: ignore[attr-defined]

    async def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await inner(*args)
        finally:
            CHILD.append(time.perf_counter() - t0)

    rollout._child = timed  # type: ignore[attr-defined]


async def point(fleet: LaunchedFleet, model: Path, concurrency: int, tag: str) -> tuple[float, dict[str, float]]:
    assert fleet.router_url is not None and fleet.keys is not None
    (ds,) = EvalSuite(datasets=(DatasetSpec(name="bench", kind="lm_eval", tasks=tuple(TASK_NAMES),
                                            task_dir=str(TASKS)),)).resolved()
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=120) as http:
        gen = RouterGenerator(http, fleet.router_url, api_key=fleet.keys.api, max_concurrency=concurrency)
        session = PointSession(gen, expected_version="1", rid_prefix=tag, tokenizer_dir=str(model))
        samples = await run_rollouts(session, [ds], {ds.name: load_dataset(ds)})
    metrics = lm_eval_metrics(samples)
    elapsed = time.perf_counter() - t0
    assert len(samples) == 48 and {s.weight_version for s in samples} == {"1"}
    return elapsed, metrics


def measure(fleet: LaunchedFleet, model: Path, points: int, concurrency: int, base: Path) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"direct": [], "point": [], "child": []}
    _time_the_child()
    for p in range(points + 1):  # the first pair warms up
        d, want = direct(fleet, model, concurrency, base / f"hf-{p}")
        t, got = asyncio.run(point(fleet, model, concurrency, f"b{p}"))
        if got != want:
            raise SystemExit(f"bench harness: the point's metrics {got} differ from lm-eval's {want}")
        if p:
            times["direct"].append(d)
            times["point"].append(t)
            times["child"].append(CHILD[-1])
    return times


def table(times: dict[str, list[float]]) -> list[str]:
    d, p, c = (statistics.median(times[k]) for k in ("direct", "point", "child"))
    return ["| run | p50 s |", "|---|---|", f"| lm-eval directly (fresh process, router) | {d:.2f} |",
            f"| harness point (gateway + child + samples + metrics) | {p:.2f} |",
            f"| of which the lm-eval child process (its requests through the gateway) | {c:.2f} |",
            f"| overhead (point - direct) | {p - d:.2f} ({100 * (p - d) / p:.1f} % of the point) |",
            f"| of which in the child (child - direct: the gateway hop per request) | {c - d:.2f} |",
            f"| of which around it (point - child: gateway start, samples, metrics) | {p - c:.2f} |"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench harness", description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=3, help="measured runs of each kind (default 3)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight, both ways (default 4)")
    args = parser.parse_args(argv or [])
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-harness-") as tmp:
        fleet, model = start_fleet(Path(tmp), args.concurrency)
        try:
            times = measure(fleet, model, args.points, args.concurrency, Path(tmp))
        finally:
            fleet.stop()
    print(f"{args.points} runs of each, 48 documents (120 requests) each, num_concurrent {args.concurrency}, "
          f"2 CPU engines, {os.cpu_count()} CPUs, load average {load[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print("\n".join(table(times)))
