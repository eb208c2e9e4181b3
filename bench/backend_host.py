"""External-posture point cost: a backend built per point vs one kept warm in the backend host.

Side by side in one run, with the reference backend (`SGLangCheckpointEval(launch="cpu")`: it
launches a CPU engine, waits until healthy, pins the snapshot, generates, scores) on a tiny model
and two small datasets (12 prompts):
- per point: what a process-per-run worker does without a host — construct, evaluate, dispose,
  for every point (the engine is launched and stopped each time);
- hosted: one `python -m pinned_eval.backend_host` process; every point is `evaluate_hosted`
  from this process (the first one constructs the backend and launches its engine).
POINTS points per mode, alternating two snapshots; medians of the points after the first;
ratio = per point / hosted (> 1: the host is faster).

`python -m bench backend_host [--points N]`
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKEND = "trainer_integration.sglang_backend:SGLangCheckpointEval"


def _suite():  # type: ignore[no-untyped-def]
    from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults

    return EvalSuite(
        datasets=(
            DatasetSpec(name="arith_add", path="builtin:arith_add.jsonl", max_prompts=6),
            DatasetSpec(name="arith_sub", path="builtin:arith_sub.jsonl", max_prompts=6),
        ),
        defaults=SamplingDefaults(temperature=0.0, max_new_tokens=3, reward="exact_match"),
    )


def _per_point(options: dict[str, str], snaps: list[str], points: int) -> list[float]:
    from pinned_eval.external import EvalInput
    from trainer_integration.sglang_backend import SGLangCheckpointEval

    times = []
    for i in range(points):
        snap = snaps[i % 2]
        t0 = time.perf_counter()
        fn = SGLangCheckpointEval(**options)
        try:
            inp = EvalInput(run="bench", step=i + 1, hf_dir=snap, suite=_suite())
            asyncio.run(fn.evaluate_checkpoint(snap, inp))
        finally:
            fn.dispose()
        times.append(time.perf_counter() - t0)
    return times


def _hosted(options: dict[str, str], snaps: list[str], points: int, root: Path) -> list[float]:
    from pinned_eval.backend_host import evaluate_hosted, host_command, wait_host_ready
    from pinned_eval.external import EvalInput

    sock = root / "backends.sock"
    repo = Path(__file__).resolve().parents[1]
    with open(root / "host.log", "w") as log:
        host = subprocess.Popen(host_command(sock), cwd=repo, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_host_ready(sock)
            times = []
            for i in range(points):
                snap = snaps[i % 2]
                t0 = time.perf_counter()
                inp = EvalInput(run="bench", step=i + 1, hf_dir=snap, suite=_suite())
                evaluate_hosted(sock, BACKEND, options, snap, inp)
                times.append(time.perf_counter() - t0)
        finally:
            os.killpg(host.pid, signal.SIGTERM)  # the host disposes the backend (stops its engine)
            host.wait(60)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench backend_host", description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=4, help="Points per mode (>= 2).")
    args = parser.parse_args(argv or [])
    from engine.tiny_model import make_tiny_model, perturb_snapshot

    with tempfile.TemporaryDirectory(prefix="bench-backend-host-") as tmp:
        root = Path(tmp)
        base = make_tiny_model(root / "base", arch="llama", seed=0)
        snaps = [str(perturb_snapshot(base, root / f"step{i}", scale=0.01, seed=i)) for i in (1, 2)]
        options = {"launch": "cpu", "model_path": str(base), "log_dir": str(root / "logs")}
        per_point = _per_point(options, snaps, args.points)
        hosted = _hosted(options, snaps, args.points, root)
    rows = [("per point (build, eval, dispose)", per_point), ("hosted (built once)", hosted)]
    print(f"{'external point, ' + str(args.points) + ' points':<36} {'first':>8} {'later p50':>10} {'later max':>10}")
    for name, t in rows:
        print(f"{name:<36} {t[0]:>7.2f}s {statistics.median(t[1:]):>9.2f}s {max(t[1:]):>9.2f}s")
    ratio = statistics.median(per_point[1:]) / statistics.median(hosted[1:])
    print(f"ratio per point / hosted (later p50): {ratio:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
