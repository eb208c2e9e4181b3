"""History size: what an operation costs as one run's history grows (SQLite or PostgreSQL Prefect server).

Seeds one run with N completed eval points (N = 100, 1,000, 10,000 by default, cumulatively; one
RUNNING point at the end) through the REST API (`bench.history_seed`: flow runs created directly
in their final state), then times side by side at each N:

- `refresh`: the trainer's admission refresh as it runs every `poll_s` while a point is in flight
  (`AdmissionSync.refresh` after its first answer: what can be in flight or changed since);
- `full read`: the whole-history query (`PrefectRest.point_runs`, what every refresh sent before;
  the admission thread now sends it once, at start);
- `status`: `read_history(run, last=50)`, what `pinned-eval status --run R` reads by default;
- `best`: `pinned-eval best`'s read (`best_from_ledger`: ranked from the JSONL ledger, the best
  candidates' flow runs confirmed);
- `rerun lookup`: `step_runs`, how `rerun` (and `request`) find a step's flow runs; the janitor's
  sweep reads its snapshots' steps the same way (`step_point_flow_runs`);
- `trainer wait_for`: `EvalClient.wait_for(step)`'s read (`PointOutcomes.outcomes_of`; `best`
  reads the same way, one page of candidates).

Each cell is the median of `--reps` calls, with the API requests and the bytes answered (counted
through a recording httpx transport). The points are seeded before the clock of the server moves
on, so the refresh's "changed since" window (`changed_margin_s=0` here) holds only the run's
in-flight point; a trainer's default margin adds the points that ended in the last two minutes.

`python -m bench history [--sizes 100,1000,10000] [--reps 5] [--db sqlite|postgres]`
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import httpx

from pinned_eval.events import BlockNames
from trainer_integration.admission import AdmissionView
from trainer_integration.outcomes import PointOutcomes
from trainer_integration.rest import PrefectRest


class _Recording(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.requests = 0
        self.bytes = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = super().handle_request(request)
        resp.read()
        self.requests += 1
        self.bytes += len(resp.content)
        return resp


def _timed(fn: Callable[[], object], rec: _Recording, reps: int) -> tuple[float, int, int]:
    """(median seconds, requests per call, bytes per call)."""
    times = []
    rec.requests = rec.bytes = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), rec.requests // reps, rec.bytes // reps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench history")
    parser.add_argument("--sizes", default="100,1000,10000", help="points in the run, comma-separated, ascending")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite",
                        help="the server's database: its own SQLite file, or a local PostgreSQL started for the bench")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    from prefect import get_client

    from app.commands.best import best_from_ledger
    from app.commands.points import step_runs
    from app.history import read_history
    from app.prefect_server import running_server
    from bench.history_seed import seed_points, server_time
    from blocks import SinksBlock
    from pinned_eval.settings import PrefectApiSettings
    from pinned_eval.sinks import Ledger, MetricRow
    from trainer_integration.admission_sync import AdmissionSync
    from trainer_integration.export_target import ExportTarget
    from trainer_integration.rest import auth_headers

    run = "bench-history"
    print(f"{'N points':>9} | {'seed s':>7} | {'first read':>28} | {'refresh':>28} | {'full read (before)':>28} | "
          f"{'status (last 50)':>18} | {'best':>18} | {'rerun lookup':>18} | {'trainer wait_for':>18}", flush=True)
    with tempfile.TemporaryDirectory() as home, _database(args.db), running_server(Path(home)) as server:
        api = server.api_url
        headers = auth_headers(PrefectApiSettings())
        seed_http = httpx.Client(base_url=api, headers=headers, timeout=60)
        ledger = Ledger(Path(home) / "metrics.jsonl")
        SinksBlock(jsonl_path=str(ledger.path)).save("bench-history", overwrite=True)
        params = {"sinks": "bench-history"}
        seeded = 0
        for n in sizes:
            t0 = time.perf_counter()
            seed_points(seed_http, run, range(seeded + 1, n + 1), parameters=params)
            seed_s = time.perf_counter() - t0
            ledger.write_point([
                MetricRow(run=run, step=s, dataset="arith", state="measured", weight_version=str(s),
                          metrics={"eval/arith": (s % 997) / 997})
                for s in range(seeded + 1, n + 1)
            ])  # fmt: skip
            if seeded == 0:
                seed_points(seed_http, run, range(10**9, 10**9 + 1), "RUNNING", parameters=params)
            seeded = n
            at = server_time(seed_http)
            while server_time(seed_http) <= at:  # what ended before now is history
                time.sleep(0.1)

            rec = _Recording()
            rest = PrefectRest(api, httpx.Client(transport=rec, headers=headers, timeout=60))
            sync = AdmissionSync(
                run, rest, AdmissionView(run, visible_timeout_s=30), ExportTarget(None, None), BlockNames(),
                spooled=set, enqueue=lambda e: None, poll_s=30, idle_sync_s=30, changed_margin_s=0,
            )  # fmt: skip
            first = _timed(sync.refresh, rec, 1)
            refresh = _timed(sync.refresh, rec, args.reps)
            full = _timed(partial(rest.point_runs, run), rec, max(1, args.reps // 2))
            prec = _Recording()
            with get_client(sync_client=True, httpx_settings={"transport": prec}) as client:
                status = _timed(partial(read_history, run, client=client, last=50), prec, args.reps)
                best = _timed(partial(best_from_ledger, client, run, "arith", 1.0), prec, args.reps)
                lookup = _timed(partial(step_runs, client, run, n // 2), prec, args.reps)
            outcomes = _Trainer(run, rest, BlockNames(sinks="bench-history"))
            wait = _timed(partial(outcomes.outcomes_of, [n // 2]), rec, args.reps)
            print(f"{n:>9} | {seed_s:7.1f} | {_cell(first)} | {_cell(refresh)} | {_cell(full)} | "
                  f"{_short(status)} | {_short(best)} | {_short(lookup)} | {_short(wait)}", flush=True)


def _short(c: tuple[float, int, int]) -> str:
    return f"{c[0] * 1000:7.1f} ms {c[1]:>2} req"


class _Trainer(PointOutcomes):
    """The trainer's outcome readers (`PointOutcomes`, as `EvalClient` mixes them in)."""

    def __init__(self, run: str, rest: PrefectRest, blocks: BlockNames) -> None:
        self.run, self.rest, self.blocks = run, rest, blocks
        self.admission = AdmissionView(run, visible_timeout_s=30)


@contextmanager
def _database(kind: str) -> Iterator[None]:
    """The server's database for the block: SQLite (nothing to do), or a fresh local PostgreSQL
    (`bench.burst.running_postgres`) named to the server by `PREFECT_API_DATABASE_CONNECTION_URL`."""
    if kind == "sqlite":
        yield
        return
    from app.prefect_server import env_set, free_port
    from bench.burst import running_postgres

    with running_postgres(free_port()) as pg, env_set(PREFECT_API_DATABASE_CONNECTION_URL=pg.url):
        yield


def _cell(c: tuple[float, int, int]) -> str:
    return f"{c[0] * 1000:7.1f} ms {c[1]:>2} req {c[2] / 1024:7.1f} KiB"

