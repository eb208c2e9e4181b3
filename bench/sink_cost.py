"""Per-point cost of each sink: logging one point's record, as a share of the point's duration.

The point: the demo's suite (`arith_add` + `arith_sub`, 64 prompts each, greedy) through the real
eval-point flow on a local Prefect server, 2 CPU engines behind sglang-router, a tiny model, its
sinks block writing JSONL and the samples file only; its wall time is the median of `--reps`
points after a warm-up. Then that point's record (its two ledger rows, its 128 samples) is logged
`--reps` times to each sink, each time at a new step, after one untimed warm-up call per sink
(imports, first connection, the run's creation: printed apart, it is what a point pays in a fresh
worker process), sinks alternating:
- `jsonl`: the ledger write (`Ledger.write_point`, into a file already holding the points' rows);
- `wandb`: W&B offline, the dedicated eval run (`eval_run` writer: init, log, finish), with a
  table of 8 samples per dataset;
- `mlflow`: a real `mlflow server` on 127.0.0.1 (SQLite store, local artifact root), a run of its
  own found by its tag, the metrics in one batch and an 8-sample table per dataset;
- `tensorboard`: one event file in a local log directory;
- `wandb deferred`, `mlflow deferred`: what the point pays under `pinned-eval worker`, where the
  remote trackers leave its path: the parcel made and posted into an outbox served by a real
  deliverer process (`python -m app.deliverer`, as the stack starts it). The time until that
  deliverer has sent it (post to the envelope's removal, polled every 10 ms) is printed apart: it
  is off the point's path, and the next timed call starts only after it.
Goal: each ≤ 1 % of the point (as for the samples file).

`python -m bench sink_cost [--reps N]`
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SINKS = ("jsonl", "wandb", "mlflow", "tensorboard", "wandb deferred", "mlflow deferred")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench sink_cost")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv or [])
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from app.prefect_server import running_server

    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp) / "home"):
        point_s, per_sink = _measure(Path(tmp), args.reps)
    _print(point_s, per_sink, args.reps)


def _measure(root: Path, reps: int) -> tuple[list[float], dict[str, list[float]]]:
    from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
    from engine.tiny_model import make_tiny_model
    from flows.eval_point import eval_point
    from pinned_eval.fleet import launch_cpu_fleet
    from pinned_eval.suite import default_suite

    base = make_tiny_model(root / "base", seed=0)
    fleet = launch_cpu_fleet(base, 2, log_dir=root / "logs", state_file=root / "fleet.json")
    try:
        FleetBlock(name="bench", mode="launch", state_file=str(root / "fleet.json")).save("bench", overwrite=True)
        EvalSuiteBlock(suite=default_suite()).save("bench", overwrite=True)
        staging = StagingBlock(root=str(root / "staging"), keep_snapshots=0, source_roots=[str(root)])
        staging.save("bench", overwrite=True)
        sinks = SinksBlock(jsonl_path=str(root / "metrics.jsonl"), results_root=str(root / "results"))
        sinks.save("bench", overwrite=True)
        source = {"kind": "hf", "path": str(base), "require_marker": False}
        point_s = []
        for step in range(reps + 1):  # step 0: warm-up (imports, first pin, first client)
            t0 = time.perf_counter()
            state = eval_point(run="bench", step=step, source=source, suite="bench", fleet="bench",
                               staging="bench", sinks="bench", return_state=True)
            seconds = time.perf_counter() - t0
            assert state.name == "Completed", state.message
            if step:
                point_s.append(seconds)
    finally:
        fleet.stop()
    return point_s, _sink_times(root, sinks, reps, last_step=reps)


def _sink_times(root: Path, sinks: Any, reps: int, last_step: int) -> dict[str, list[float]]:
    from pinned_eval.results.store import SAMPLES
    from pinned_eval.sinks import Ledger, MetricRow, PointRecord, PointSamples
    from pinned_eval.sinks.mlflow import MlflowConfig, MlflowExporter
    from pinned_eval.sinks.outbox import OUTBOX_ENV, Outbox, defer
    from pinned_eval.sinks.tensorboard import TensorboardExporter
    from pinned_eval.sinks.wandb import WandbConfig, WandbExporter
    from tests.mlflow_server import MlflowServer

    ledger = Ledger(sinks.jsonl_path)
    rows = [r for r in ledger.read("bench") if r.step == last_step]
    store = sinks.results_store()
    samples = PointSamples(results={}, rows=store.read("bench", last_step, SAMPLES).to_pylist())
    (root / "mlflow").mkdir()
    server = MlflowServer(root / "mlflow")
    outbox = Outbox(root / "outbox")
    os.environ[OUTBOX_ENV] = str(outbox.root)
    deliverer = subprocess.Popen([sys.executable, "-m", "app.deliverer", str(outbox.root)],
                                 stderr=subprocess.DEVNULL)
    try:
        while not outbox.served():
            assert deliverer.poll() is None, "the deliverer exited"
            time.sleep(0.05)
        wandb = WandbExporter(WandbConfig(project="bench", mode="offline", directory=str(root / "wandb"),
                                          samples_per_dataset=8), store)
        mlflow = MlflowExporter(MlflowConfig(tracking_uri=server.url, samples_per_dataset=8))
        tensorboard = TensorboardExporter(str(root / "tb"), None)

        def record(step: int) -> PointRecord:
            moved = [MetricRow.model_validate({**r.model_dump(), "step": step}) for r in rows]
            if step != last_step:  # the W&B table reads the point's samples file
                store.write("bench", step, SAMPLES, store.read("bench", last_step, SAMPLES))
            return PointRecord("bench", step, moved, None, samples)

        def deferred(exporter: Any) -> Callable[[PointRecord], None]:
            def call(rec: PointRecord) -> None:
                assert defer([exporter], rec, sinks.jsonl_path)[1] == [exporter.name], "not deferred"
            return call

        calls: dict[str, Callable[[PointRecord], None]] = {
            "jsonl": lambda rec: ledger.write_point(rec.rows),
            "wandb": wandb.export,
            "mlflow": mlflow.export,
            "tensorboard": tensorboard.export,
            "wandb deferred": deferred(wandb),
            "mlflow deferred": deferred(mlflow),
        }
        out: dict[str, list[float]] = {name: [] for name in SINKS}
        for i in range(reps + 1):  # i = 0: the first call (imports, first connection, the run's creation)
            rec = record(100 + i)
            for name in SINKS:
                t0 = time.perf_counter()
                calls[name](rec)
                (out[name] if i else out.setdefault(f"{name} first", [])).append(time.perf_counter() - t0)
                if name.endswith("deferred"):
                    while outbox.pending():
                        time.sleep(0.01)
                    out.setdefault(f"{name} sent", []).append(time.perf_counter() - t0)
        return out
    finally:
        deliverer.terminate()
        deliverer.wait(timeout=60)
        os.environ.pop(OUTBOX_ENV, None)
        server.kill()


def _print(point_s: list[float], per_sink: dict[str, list[float]], reps: int) -> None:
    point = statistics.median(point_s)
    print(f"demo point (128 samples, 2 CPU engines): median {point:.2f} s of {reps} "
          f"({' '.join(f'{s:.2f}' for s in point_s)})")
    print(f"{'sink':14}{'median s':>10}{'share of the point':>20}   per repetition (s)")
    for name in SINKS:
        med = statistics.median(per_sink[name])
        print(f"{name:14}{med:10.4f}{med / point:19.2%}    {' '.join(f'{s:.4f}' for s in per_sink[name])}")
    print("first call in the process (imports, first connection, run creation), s: "
          + "; ".join(f"{name} {per_sink[f'{name} first'][0]:.2f}" for name in SINKS))
    print("deferred, off the point's path: posted to sent by the deliverer, s (first call excluded): "
          + "; ".join(f"{name.split()[0]} {' '.join(f'{s:.2f}' for s in per_sink[f'{name} sent'][1:])}"
                      for name in SINKS if name.endswith("deferred")))
    print(f"goal: each <= 1% of the point\nload average (1 min) at the end: {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main(sys.argv[1:])
