"""Prometheus metrics of the points a worker runs, exact across its flow-run processes (no Prefect import).

Each point runs in a flow-run process of its own, so counters kept in memory die with it. Instead,
a flow run records what happened as small files in the worker's metrics directory
(`PINNED_EVAL_METRICS_DIR`, set by `pinned-eval worker --metrics-port`), and the worker's endpoint
folds them into metrics at each scrape (`PointMetricsCollector`):

- `events/<ns>-<pid>-<n>.json`: one per point outcome (run, outcome, reason, seconds) or pin
  (fleet, seconds), written to a temp name `.tmp-p<pid>s<start>-...` then renamed, so a scrape
  never reads half a file; a temp file is never counted, and a scrape removes one whose writer is
  provably gone (killed before its rename; `writer_temps.sweep_temps`); never rewritten; the
  next scrape sums it into `totals.json` and removes it, crash-safe
  (`pinned_eval.prometheus_totals`), so counts are exact and survive a worker restart (the
  directory stays) and a scrape reads only the events since the last one;
- `inflight/<pid>-<n>.json`: one per point running now (its run), removed when it ends; the
  file of a process that died without removing it (SIGKILL) is dropped at the next scrape, and
  so is its temp file.

The directory is a 0700 directory of this user, the whole path trusted
(`pinned_eval.trusted_paths`): a neighbour can neither plant nor read an event; anything else is
refused (nothing recorded, one warning). Recording never raises into a point: an error is one
warning and the point goes on. prometheus_client is needed by the endpoint only (the
`prometheus` extra), never by a flow run.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pinned_eval.processes import pid_alive
from pinned_eval.prometheus_totals import (
    EVENTS,
    PIN_BUCKETS,
    POINT_BUCKETS,
    Outcome,
    PointEvent,
    TotalsUnreadableError,
    fold,
)
from pinned_eval.sinks.outbox import envelopes_waiting
from pinned_eval.trusted_paths import make_private_dir
from pinned_eval.writer_temps import sweep_temps, temp_name

log = logging.getLogger(__name__)
METRICS_DIR_ENV = "PINNED_EVAL_METRICS_DIR"
INFLIGHT = "inflight"
__all__ = ["EVENTS", "INFLIGHT", "PIN_BUCKETS", "POINT_BUCKETS", "InFlight", "Outcome", "PointEvent",
           "PointMetricsCollector", "pin_timed", "point_ended", "private_metrics_dir", "serve_metrics"]
_NAME = re.compile(r"^(\d+)-(\d+)\.json$")  # inflight/<pid>-<n>.json
_seq = itertools.count()


def private_metrics_dir(path: str | Path) -> Path:
    """Create (0700) or check the metrics directory and its two subdirectories; raise
    `UntrustedPathError` naming the path unless every one is this user's alone (mode 0700)."""
    root = Path(path)
    for d in (root, root / EVENTS, root / INFLIGHT):
        make_private_dir(str(d), "metrics directory")
    return root


def _recording_dir() -> Path | None:
    """The checked metrics directory of this process's worker; None when metrics are off."""
    path = os.environ.get(METRICS_DIR_ENV)
    return private_metrics_dir(path) if path else None


def _write_private(path: Path, payload: str) -> None:
    tmp = path.with_name(temp_name(path.name))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, payload.encode())
    finally:
        os.close(fd)
    os.rename(tmp, path)


def _record(what: str, action: Any) -> None:
    try:
        root = _recording_dir()
        if root is not None:
            action(root)
    except (OSError, ValueError) as exc:  # UntrustedPathError is a ValueError: a metric is never worth a point
        log.warning("prometheus metrics: %s not recorded: %s", what, exc)


def _event(event: PointEvent) -> None:
    def write(root: Path) -> None:
        _write_private(root / EVENTS / f"{time.time_ns():020d}-{os.getpid()}-{next(_seq)}.json",
                       event.model_dump_json(exclude_none=True))

    _record(f"{event.kind} event", write)


class InFlight:
    """A point in flight from `start()` to `end()` (the `pinned_eval_points_in_flight` gauge)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self._path: Path | None = None

    def start(self) -> InFlight:
        def write(root: Path) -> None:
            path = root / INFLIGHT / f"{os.getpid()}-{next(_seq)}.json"
            _write_private(path, json.dumps({"run": self.run}))
            self._path = path

        _record("point in flight", write)
        return self

    def end(self) -> None:
        if self._path is not None:
            try:
                self._path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("prometheus metrics: point in flight not cleared: %s", exc)
            self._path = None


def point_ended(run: str, outcome: Outcome, reason: str = "", seconds: float | None = None) -> None:
    """Record one point of `run` ended `outcome` (`reason`: its skip reason; "" when measured)."""
    _event(PointEvent(kind="point", run=run, outcome=outcome, reason=reason, seconds=seconds))


def pin_timed(fleet: str, seconds: float) -> None:
    """Record one successful pin of `fleet` that took `seconds`."""
    _event(PointEvent(kind="pin", fleet=fleet, seconds=seconds))


class PointMetricsCollector:
    """The worker's metrics, read from `root` at each scrape: the new event files are folded into
    `root/totals.json` and removed (`pinned_eval.prometheus_totals`), so a scrape reads the totals
    and the events since the last scrape, never the whole history."""

    def __init__(self, root: str | Path, outbox: str | Path | None = None) -> None:
        self.root = private_metrics_dir(root)
        self.outbox = Path(outbox) if outbox is not None else None
        self._lock = threading.Lock()

    @staticmethod
    def _unreadable(name: str, exc: Exception) -> None:
        log.warning("prometheus metrics: event %s unreadable: %s", name, exc)

    @staticmethod
    def _orphan(name: str) -> None:
        log.warning("prometheus metrics: removed %s: its writer died before renaming it (not counted)", name)

    def in_flight(self) -> dict[str, int]:
        """Points running now, per run; files of dead processes are removed, and their temp files."""
        sweep_temps(self.root / INFLIGHT, self._orphan)
        runs: dict[str, int] = {}
        for name in os.listdir(self.root / INFLIGHT):
            m = _NAME.match(name)
            if m is None:
                continue
            path = self.root / INFLIGHT / name
            if not pid_alive(int(m.group(1))):
                path.unlink(missing_ok=True)
                continue
            try:
                run = json.loads(path.read_bytes()[:65536])["run"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # ended meanwhile, or not ours to read
            runs[str(run)] = runs.get(str(run), 0) + 1
        return runs

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        private_metrics_dir(self.root)  # still this user's alone, 0700
        with self._lock:
            try:
                totals = fold(self.root, self._unreadable, self._orphan)
            except (OSError, TotalsUnreadableError) as exc:  # nothing folded, nothing lost: one line, no traceback
                log.error("prometheus metrics: scrape without point metrics: %s", exc)
                totals = None
        if totals is not None:
            points = CounterMetricFamily("pinned_eval_points", "Points that ended, by run, outcome and skip reason.",
                                         labels=["run", "outcome", "reason"])
            for (run, outcome, reason), n in sorted(totals.points.items()):
                points.add_metric([run, outcome, reason], n)
            dur = HistogramMetricFamily("pinned_eval_point_duration_seconds",
                                        "Wall time of a point from its flow's start to its outcome.",
                                        labels=["run", "outcome"])
            for (run, outcome), h in sorted(totals.durations.items()):
                dur.add_metric([run, outcome], h.cumulative(), h.total)
            pin = HistogramMetricFamily("pinned_eval_pin_duration_seconds",
                                        "Time to pin a fleet to a weight version (successful pins).", labels=["fleet"])
            for fleet, h in sorted(totals.pins.items()):
                pin.add_metric([fleet], h.cumulative(), h.total)
            bad = CounterMetricFamily("pinned_eval_metrics_unreadable_events",
                                      "Event files of the metrics directory that could not be read.")
            bad.add_metric([], totals.unreadable)
            yield from (points, dur, pin, bad)
        flight = GaugeMetricFamily("pinned_eval_points_in_flight", "Points running now, by run.", labels=["run"])
        for run, n in sorted(self.in_flight().items()):
            flight.add_metric([run], n)
        yield flight
        if self.outbox is not None:
            yield GaugeMetricFamily("pinned_eval_tracker_exports_waiting",
                                    "Points' W&B/MLflow exports in the worker's outbox, not sent by its deliverer yet.",
                                    value=self.exports_waiting())

    def exports_waiting(self) -> int:
        """Envelopes in the outbox (names only: nothing is read; none when it does not exist yet)."""
        assert self.outbox is not None
        return envelopes_waiting(self.outbox)


def serve_metrics(
    root: str | Path, port: int, host: str = "127.0.0.1", outbox: str | Path | None = None
) -> tuple[Any, str]:
    """Serve the worker's metrics at `http://host:port/metrics` (port 0: any free one) from a
    daemon thread; returns the server (`shutdown()` stops it) and the URL. `outbox`: the worker's
    tracker outbox, counted by `pinned_eval_tracker_exports_waiting`."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(PointMetricsCollector(root, outbox))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return server, f"http://{shown}:{bound_port}/metrics"
