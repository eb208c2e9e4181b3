"""How long a non-waiting `EvalClient.dispatch` stalls the training loop, side by side with a
trainer that posts the event inline (one synchronous `POST /api/events` per point).

One local Prefect server (SQLite). Rounds alternate between the variants so they share the load
of the moment:
- `dispatch`: EvalClient's non-waiting path = admission query (`POST /flow_runs/filter`, twice)
  + fsync'd spool append; the event goes out on the background thread;
- `inline POST`: plain httpx `POST /api/events`, nothing durable, no admission;
- `spool append`: the fsync'd write-ahead alone;
- `dispatch, API down`: the same call against a closed port (admits offline, spools);
- `report_progress`: the per-step progress call (hands the value to a thread).
Figures are per call; ratios are p50 against `inline POST`.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

from app.prefect_server import free_port, start_server, stop_server
from pinned_eval.events import BlockNames, post_events
from pinned_eval.points import PointRequest, SnapshotSource
from trainer_integration.client import EvalClient
from trainer_integration.events import event_entry
from trainer_integration.spool import Spool

ROUNDS = 4
PER_ROUND = 40
SOURCE = SnapshotSource(kind="hf", path="/ckpt/step", require_marker=False)


def _timed(fn: Callable[[int], object], steps: range) -> list[float]:
    out = []
    for step in steps:
        t0 = time.perf_counter()
        fn(step)
        out.append(time.perf_counter() - t0)
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def measure(api: str, work: Path) -> dict[str, list[float]]:
    res: dict[str, list[float]] = {k: [] for k in ("dispatch", "inline POST", "spool append", "dispatch, API down")}
    res["report_progress"] = []
    http = httpx.Client(timeout=10)
    spool = Spool(work / "bare-spool")
    dead = f"http://127.0.0.1:{free_port()}/api"
    for rnd in range(ROUNDS):
        run = f"bench{rnd}-{uuid.uuid4().hex[:6]}"
        steps = range(PER_ROUND)
        with EvalClient(run, api, max_in_flight=64, spool_dir=work / "spool", poll_s=0.05) as client:
            res["dispatch"] += _timed(lambda s, c=client: c.dispatch(s, source=SOURCE), steps)
            res["report_progress"] += _timed(lambda s, c=client: c.report_progress(s), steps)
            client.deliverer.flush(60)
        inline_run = f"inline{rnd}-{uuid.uuid4().hex[:6]}"

        def inline(step: int, r: str = inline_run) -> None:
            req = PointRequest(run=r, step=step, source=SOURCE)
            post_events(api, [event_entry(req, BlockNames()).body], client=http)

        res["inline POST"] += _timed(inline, steps)
        res["spool append"] += _timed(
            lambda s, r=run: spool.append(event_entry(PointRequest(run=r, step=s, source=SOURCE), BlockNames())), steps
        )
        with EvalClient(run, dead, max_in_flight=64, spool_dir=work / "dead-spool") as offline:
            res["dispatch, API down"] += _timed(lambda s, c=offline: c.dispatch(s, source=SOURCE), steps)
    http.close()
    return res


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = start_server(work / "home")
        try:
            res = measure(server.api_url, work)
        finally:
            stop_server(server.pid)
    base = statistics.median(res["inline POST"])
    print(f"{'variant':<22}{'n':>5}{'p50 ms':>10}{'p99 ms':>10}{'p50 / inline POST':>20}")
    for name, values in res.items():
        p50 = statistics.median(values)
        print(f"{name:<22}{len(values):>5}{1000 * p50:>10.2f}{1000 * _pct(values, 0.99):>10.2f}{p50 / base:>20.2f}")


if __name__ == "__main__":
    main()
