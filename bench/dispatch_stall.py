"""How long a non-waiting `EvalClient.dispatch` stalls the training loop with the API up, slow,
refusing and unreachable, side by side with a trainer that posts the event inline (one
synchronous `POST /api/events` per point).

One local Prefect server (SQLite). Rounds alternate between the variants so they share the load
of the moment:
- `dispatch, API up`: admission from the client's local state (kept fresh by its admission
  thread) + the fsync'd spool append; everything on the network happens on background threads;
- `dispatch, API slow`: the same server behind a proxy that delays every request by 500 ms;
- `dispatch, API refusing`: a proxy answering 503 to everything;
- `dispatch, API unreachable`: a closed port;
- `inline POST`: plain httpx `POST /api/events` to the server, nothing durable, no admission;
- `spool append`: the fsync'd write-ahead alone;
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

from app.prefect_server import env_set, free_port, start_server, stop_server
from pinned_eval.events import BlockNames, post_events
from pinned_eval.points import PointRequest, SnapshotSource
from pinned_eval.settings import PrefectApiSettings
from tests.reliability.netfaults import FaultyHTTPProxy, Rule
from trainer_integration.client import EvalClient
from trainer_integration.events import event_entry
from trainer_integration.rest import api_client
from trainer_integration.spool import Spool

ROUNDS = 4
PER_ROUND = 40
SOURCE = SnapshotSource(kind="hf", path="/ckpt/step", require_marker=False)
APIS = ("up", "slow", "refusing", "unreachable")


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
    res: dict[str, list[float]] = {f"dispatch, API {a}": [] for a in APIS}
    res |= {"inline POST": [], "spool append": [], "report_progress": []}
    http = api_client(PrefectApiSettings(), timeout_s=10)  # the server's credential, as the clients send it
    spool = Spool(work / "bare-spool")
    upstream = api.removesuffix("/api")
    slow = FaultyHTTPProxy(upstream, rules=[Rule("delay", delay_s=0.5)])
    refusing = FaultyHTTPProxy(upstream, rules=[Rule("error", status=503)])
    urls = {"up": api, "slow": f"{slow.url}/api", "refusing": f"{refusing.url}/api",
            "unreachable": f"http://127.0.0.1:{free_port()}/api"}
    try:
        for rnd in range(ROUNDS):
            steps = range(PER_ROUND)
            for name, url in urls.items():
                run = f"bench{rnd}-{name}-{uuid.uuid4().hex[:6]}"
                with EvalClient(run, url, max_in_flight=64, spool_dir=work / "spool", direct_runs=False) as client:
                    res[f"dispatch, API {name}"] += _timed(lambda s, c=client: c.dispatch(s, source=SOURCE), steps)
                    if name == "up":
                        res["report_progress"] += _timed(lambda s, c=client: c.report_progress(s), steps)
                        client.deliverer.flush(60)
            inline_run = f"inline{rnd}-{uuid.uuid4().hex[:6]}"

            def inline(step: int, r: str = inline_run) -> None:
                req = PointRequest(run=r, step=step, source=SOURCE)
                post_events(api, [event_entry(req, BlockNames()).body], client=http)

            res["inline POST"] += _timed(inline, steps)
            res["spool append"] += _timed(
                lambda s, r=inline_run: spool.append(event_entry(PointRequest(run=r, step=s, source=SOURCE),
                                                                 BlockNames())), steps,
            )
    finally:
        slow.close()
        refusing.close()
        http.close()
    return res


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = start_server(work / "home")
        try:
            with env_set(PREFECT_API_AUTH_STRING=server.auth_string):
                res = measure(server.api_url, work)
        finally:
            stop_server(server.pid)
    base = statistics.median(res["inline POST"])
    print(f"{'variant':<28}{'n':>5}{'p50 ms':>10}{'p99 ms':>10}{'p50 / inline POST':>20}")
    for name, values in res.items():
        p50 = statistics.median(values)
        print(f"{name:<28}{len(values):>5}{1000 * p50:>10.2f}{1000 * _pct(values, 0.99):>10.2f}{p50 / base:>20.2f}")


if __name__ == "__main__":
    main()
