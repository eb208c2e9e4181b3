"""First-call cost of each tracker sink in a flow run forked from the warm-start server, with and
without the server preloading the trackers' modules (`app.warm_start.server._preload`).

Each repetition starts two fresh server-like processes, alternating: `cold` imports the server's
`PRELOAD` only (Prefect and the eval-point flow: what the server imported before it preloaded the
trackers), `preloaded` runs the server's `_preload` (the same plus every installed tracker's
modules, timed: what the server pays once at start, and the memory it adds). Each then forks, as
the server forks a flow run, and the forked process logs one point to each sink twice: the first
call (what a point pays) and a second one (the steady per-point cost):
- `wandb`: W&B offline, the dedicated eval run (init, log, finish), no tables;
- `mlflow`: a real `mlflow server` on 127.0.0.1 (SQLite store), a run of its own per process;
- `tensorboard`: one event file in a local log directory.

`python -m bench tracker_preload [--reps N]`
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SINKS = ("wandb", "mlflow", "tensorboard")
REPO = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _export_twice(root: Path, mlflow_url: str, run: str) -> dict[str, list[float]]:
    from pinned_eval.sinks import MetricRow, PointRecord
    from pinned_eval.sinks.mlflow import MlflowConfig, MlflowExporter
    from pinned_eval.sinks.tensorboard import TensorboardExporter
    from pinned_eval.sinks.wandb import WandbConfig, WandbExporter

    exporters = {
        "wandb": WandbExporter(WandbConfig(project="bench", mode="offline", directory=str(root / "wandb")), None),
        "mlflow": MlflowExporter(MlflowConfig(tracking_uri=mlflow_url)),
        "tensorboard": TensorboardExporter(str(root / "tb"), None),
    }
    out: dict[str, list[float]] = {name: [] for name in SINKS}
    for step in (1, 2):
        rows = [MetricRow(run=run, step=step, dataset=ds, state="measured", metrics={f"eval/{ds}": 0.5})
                for ds in ("arith_add", "arith_sub")]
        for name in SINKS:
            t0 = time.perf_counter()
            exporters[name].export(PointRecord(run, step, rows))
            out[name].append(time.perf_counter() - t0)
    return out


def _server_like(mode: str, root: Path, mlflow_url: str, run: str) -> None:
    """One server-like process: import as the server does, fork, time the sinks in the child."""
    from app.warm_start import server

    rss0 = _rss_mib()
    t0 = time.perf_counter()
    if mode == "preloaded":
        server._preload()
    else:
        for module in server.PRELOAD:
            importlib.import_module(module)
    start = {"import_s": time.perf_counter() - t0, "rss_mib": _rss_mib() - rss0}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            result = _export_twice(root, mlflow_url, run)
        except BaseException as exc:  # reported to the parent, never raised past the fork
            result = {"error": [repr(exc)]}  # type: ignore[dict-item]
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        result = json.loads(f.read())
    os.waitpid(pid, 0)
    print(json.dumps({**start, **result}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench tracker_preload")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--child", nargs=4, metavar=("MODE", "ROOT", "MLFLOW_URL", "RUN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv or [])
    if args.child:
        mode, root, url, run = args.child
        _server_like(mode, Path(root), url, run)
        return
    from tests.mlflow_server import MlflowServer

    results: dict[str, list[dict[str, float | list[float]]]] = {"cold": [], "preloaded": []}
    with tempfile.TemporaryDirectory(prefix="bench-preload-") as tmp:
        (Path(tmp) / "mlflow").mkdir()
        server = MlflowServer(Path(tmp) / "mlflow")
        try:
            for rep in range(args.reps):
                for mode in ("cold", "preloaded") if rep % 2 == 0 else ("preloaded", "cold"):
                    root = Path(tmp) / f"{mode}-{rep}"
                    done = subprocess.run(
                        [sys.executable, "-m", "bench.tracker_preload", "--child", mode, str(root), server.url,
                         f"bench-{mode}-{rep}"], capture_output=True, text=True, cwd=REPO, timeout=600)
                    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                    if done.returncode != 0 or not lines:
                        raise SystemExit(f"{mode} rep {rep} failed:\n{done.stderr[-3000:]}")
                    result = json.loads(lines[-1])
                    if "error" in result:
                        raise SystemExit(f"{mode} rep {rep}: a sink failed: {result['error'][0]}")
                    results[mode].append(result)
        finally:
            server.kill()
    for mode, reps in results.items():
        imports = " ".join(f"{r['import_s']:.2f}" for r in reps)
        print(f"{mode}: server imports {imports} s, "
              f"+{statistics.median(float(r['rss_mib']) for r in reps):.0f} MiB RSS")  # type: ignore[arg-type]
        for name in SINKS:
            firsts = " ".join(f"{r[name][0]:.2f}" for r in reps)  # type: ignore[index]
            seconds = " ".join(f"{r[name][1]:.3f}" for r in reps)  # type: ignore[index]
            print(f"  {name:12} first call {firsts} s; second call {seconds} s")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main(sys.argv[1:])
