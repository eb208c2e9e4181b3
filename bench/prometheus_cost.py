"""Prometheus instrumentation: what it adds to a point, and what a scrape costs as events pile up.

Per point, a flow run records into the worker's metrics directory (`pinned_eval.prometheus`):
the in-flight file (written at the start, removed at the end), one pin event (fleet posture)
and one outcome event: 3 small private files written and renamed, one removed. Measured here
exactly as a point calls them, in a fresh 0700 directory on the same disk as the temp directory,
side by side with the point's JSONL ledger write (`Ledger.write_point` of a 2-dataset point,
which every point makes), alternating. Then the worker's side: a scrape (the collector's
`collect()`, as the endpoint calls it) after N events, first (every event read and folded into
the totals file, as for a directory written before folding existed), 5 times more with 10 new events each, from
a new collector (a restarted worker) with 10 more, and once with none new: only the new events
and the totals are read.

`python -m bench prometheus_cost [--points N] [--events N ...]`
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def _instrumented_point(run: str) -> None:
    from pinned_eval import prometheus as prom

    flight = prom.InFlight(run).start()
    prom.pin_timed("bench-fleet", 1.25)
    prom.point_ended(run, "measured", "", 42.0)
    flight.end()


def _ledger_point(ledger: object, run: str, step: int) -> None:
    from pinned_eval.sinks.ledger import MetricRow

    rows = [MetricRow(run=run, step=step, dataset=ds, state="measured", metrics={f"eval/{ds}": 0.5})
            for ds in ("arith_add", "arith_sub")]
    ledger.write_point(rows)  # type: ignore[attr-defined]


def _scrape(collector: object) -> float:
    t = time.perf_counter()
    list(collector.collect())  # type: ignore[attr-defined]
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench prometheus_cost")
    parser.add_argument("--points", type=int, default=300)
    parser.add_argument("--events", type=int, nargs="*", default=[1000, 10000])
    args = parser.parse_args(argv or [])

    from pinned_eval import prometheus as prom
    from pinned_eval.sinks import Ledger

    with tempfile.TemporaryDirectory(prefix="bench-prom-") as tmp:
        root = Path(tmp) / "metrics"
        os.environ[prom.METRICS_DIR_ENV] = str(root)
        prom.private_metrics_dir(root)
        ledger = Ledger(str(Path(tmp) / "metrics.jsonl"))
        instrumented, jsonl = [], []
        for i in range(args.points):
            t = time.perf_counter()
            _instrumented_point("bench")
            instrumented.append(time.perf_counter() - t)
            t = time.perf_counter()
            _ledger_point(ledger, "bench", i)
            jsonl.append(time.perf_counter() - t)
        med_i, med_j = statistics.median(instrumented), statistics.median(jsonl)
        p99 = sorted(instrumented)[int(0.99 * (len(instrumented) - 1))]
        print(f"per point ({args.points} points): instrumentation median {med_i * 1e3:.3f} ms, "
              f"p99 {p99 * 1e3:.3f} ms; JSONL ledger write median {med_j * 1e3:.3f} ms; ratio {med_i / med_j:.2f}")
        for reference in (3.0, 12.0):
            print(f"  share of a {reference:g} s point: {100 * med_i / reference:.4f} %")

        for n in args.events:
            os.environ[prom.METRICS_DIR_ENV] = str(Path(tmp) / f"m{n}")
            for i in range(n):
                skipped = i % 3 == 0
                prom.point_ended(f"run{i % 4}", "skipped" if skipped else "measured", "busy" if skipped else "",
                                 10.0 + i % 50)
            collector = prom.PointMetricsCollector(Path(tmp) / f"m{n}")
            first = _scrape(collector)
            nexts = []
            for _ in range(5):
                for _ in range(10):
                    prom.point_ended("run0", "measured", "", 5.0)
                nexts.append(_scrape(collector))
            for _ in range(10):
                prom.point_ended("run0", "measured", "", 5.0)
            restarted = _scrape(prom.PointMetricsCollector(Path(tmp) / f"m{n}"))
            idle = _scrape(collector)
            left = len(os.listdir(Path(tmp) / f"m{n}" / prom.EVENTS))
            print(f"scrape after {n} events: first {first * 1e3:.1f} ms; next 5 (10 new each) "
                  f"{', '.join(f'{x * 1e3:.1f}' for x in nexts)} ms; after a restart (10 new) "
                  f"{restarted * 1e3:.1f} ms; none new {idle * 1e3:.1f} ms; event files left {left}")
        os.environ.pop(prom.METRICS_DIR_ENV, None)


if __name__ == "__main__":
    main()
