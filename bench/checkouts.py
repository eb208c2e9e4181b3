"""This tree against a base git revision, side by side in one run: dispatch stall and per-point
orchestration cost (the figures a change to sockets, the API or payloads must leave unchanged).

The base revision is checked out into a temporary `git worktree` (removed at the end). Rounds
alternate between the two checkouts so both meet the load of the moment; each round runs this
file's probe in a fresh interpreter with `PYTHONPATH` set to one checkout, against a local Prefect
server (SQLite) that the probe starts and stops:
- `dispatch, API up`: per-call wall time of a non-waiting `EvalClient.dispatch` (no export);
- `orchestration`: seconds per point of the eval-point shape with no-op task bodies
  (`bench.orchestration.noop_point`: admission, then seven Prefect tasks), minus nothing.
Ratios are this tree over the base.

`python -m bench checkouts --base REV [--rounds N] [--dispatches N] [--points N]`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def probe(dispatches: int, points: int) -> dict[str, list[float]]:
    """Runs inside the checkout under test (imports resolve there); JSON of samples on stdout."""
    from app.prefect_server import running_server
    from bench.orchestration import noop_point
    from pinned_eval.points import SnapshotSource
    from trainer_integration.client import EvalClient

    source = SnapshotSource(kind="hf", path="/ckpt/step", require_marker=False)
    out: dict[str, list[float]] = {"dispatch": [], "orchestration": []}
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp) / "home") as server:
        run = f"bench-{uuid.uuid4().hex[:6]}"
        with EvalClient(run, server.api_url, max_in_flight=64, spool_dir=Path(tmp) / "spool",
                        direct_runs=False) as client:
            for step in range(dispatches):
                t0 = time.perf_counter()
                client.dispatch(step, source=source)
                out["dispatch"].append(time.perf_counter() - t0)
        noop_point("bench", 0)  # warm-up: imports, limit creation, first client
        for step in range(1, points + 1):
            t0 = time.perf_counter()
            noop_point("bench", step)
            out["orchestration"].append(time.perf_counter() - t0)
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run_probe(checkout: Path, script: Path, args: list[str]) -> Any:
    """`script --probe ARGS` in a fresh interpreter whose imports resolve in `checkout`; the JSON of
    its last stdout line. (Also used by `bench.point_cost`.)"""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, str(script), "--probe", *args], cwd=checkout, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"probe failed in {checkout}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def base_worktree(rev: str) -> Iterator[Path]:
    """`rev` checked out detached into a temporary `git worktree`, removed at the end."""
    base_dir = Path(tempfile.mkdtemp(prefix="pe-bench-base-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base_dir), rev], check=True)
    try:
        yield base_dir
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_dir)], check=True)


def alternate(
    rev: str, rounds: int, one_round: Callable[[Path], dict[str, list[Any]]]
) -> dict[str, dict[str, list[Any]]]:
    """`one_round(checkout)` for the base then this tree, `rounds` times; samples per label and key."""
    samples: dict[str, dict[str, list[Any]]] = {"base": {}, "this tree": {}}
    with base_worktree(rev) as base_dir:
        for _ in range(rounds):
            for label, checkout in (("base", base_dir), ("this tree", REPO)):
                for key, values in one_round(checkout).items():
                    samples[label].setdefault(key, []).extend(values)
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench checkouts")
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dispatches", type=int, default=40, 
                        help="dispatches per round and checkout (at most 64: all admitted)")
    parser.add_argument("--points", type=int, default=5, help="no-op points per round and checkout")
    args = parser.parse_args(argv or [])
    script = Path(__file__)
    samples = alternate(args.base, args.rounds,
                        lambda co: run_probe(co, script, [str(args.dispatches), str(args.points)]))
    print(f"base {args.base} vs this tree; {args.rounds} alternating rounds")
    print(f"{'measure':<34}{'n':>6}{'base':>12}{'this tree':>12}{'ratio':>8}")
    rows = (("dispatch p50 (ms)", "dispatch", 0.5, 1000), ("dispatch p99 (ms)", "dispatch", 0.99, 1000),
            ("orchestration p50 (s/point)", "orchestration", 0.5, 1),
            ("orchestration mean (s/point)", "orchestration", None, 1))
    for name, key, q, scale in rows:
        before, after = samples["base"][key], samples["this tree"][key]
        b = statistics.mean(before) if q is None else _pct(before, q)
        a = statistics.mean(after) if q is None else _pct(after, q)
        print(f"{name:<34}{len(after):>6}{scale * b:>12.3f}{scale * a:>12.3f}{a / b:>8.2f}")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        print(json.dumps(probe(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        main(sys.argv[1:])
