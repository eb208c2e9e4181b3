"""The folded totals of the worker's metrics directory: a scrape's cost follows the new events and
the series it returns, never the number of points the directory has recorded (no Prefect import).

`fold(root)` (called by each scrape, `pinned_eval.prometheus.PointMetricsCollector`), under an
exclusive `flock` of `<root>/totals.lock` (two collectors on one directory never interleave):
1. loads `<root>/totals.json` (0600): the summed counters and histograms, and `folded`, the names
   of the event files already summed into it that may still exist;
2. removes those files (what a crash after step 4 and before step 5 left), never counting them;
3. reads the other event files (new ones) and adds them;
4. writes the new totals, with `folded` = the names of step 3 plus those step 2 could not remove,
   to a temp file, fsyncs it, renames it over `totals.json` and fsyncs the directory;
5. removes the files of step 3.
A crash before the rename of step 4 leaves the old totals and every new file (read again, once);
a crash after it leaves files named in `folded` (removed at step 2, never added twice). Counts
are exact across crashes and worker restarts; the events directory holds the events since the
last scrape only.

A `totals.json` that cannot be read (not ours, corrupt) is `TotalsUnreadableError`: nothing is
folded or removed, so no event is lost; moving the file aside restarts the counts from the
events still in `events/`.

Temp files: an event (and in-flight) file is written under `writer_temps.temp_name` and renamed;
`writer_temps.sweep_temps` (each fold, under its lock, and each in-flight read) removes the temp
file of a writer provably gone (killed before its rename): its event is lost, never half counted.
"""

from __future__ import annotations

import fcntl
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from pinned_eval.writer_temps import sweep_temps

TOTALS, LOCK, EVENTS = "totals.json", "totals.lock", "events"
Outcome = Literal["measured", "skipped", "failed"]
# Buckets (seconds): a point takes minutes to an hour; a pin seconds to minutes.
POINT_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, math.inf)
PIN_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, math.inf)
_MAX_EVENT = 65536


class TotalsUnreadableError(ValueError):
    """The totals file exists and cannot be read back (see the module docstring)."""


class PointEvent(BaseModel):
    """One recorded fact: a point's outcome (`run`, `outcome`, `reason`) or a pin (`fleet`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["point", "pin"]
    run: str = ""
    outcome: Outcome | None = None
    reason: str = ""
    fleet: str = ""
    seconds: float | None = None


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        self.counts[next(i for i, b in enumerate(self.buckets) if value <= b)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        counts = self.counts or [0] * len(self.buckets)
        return [(_le(b), float(c)) for b, c in zip(self.buckets, itertools.accumulate(counts), strict=True)]


def _le(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(bound)


@dataclass
class Totals:
    points: dict[tuple[str, str, str], int] = field(default_factory=dict)
    durations: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    pins: dict[str, Histogram] = field(default_factory=dict)
    unreadable: int = 0

    def add(self, e: PointEvent) -> None:
        if e.kind == "pin":
            if e.seconds is not None:
                self.pins.setdefault(e.fleet, Histogram(PIN_BUCKETS)).observe(e.seconds)
            return
        outcome = e.outcome or "failed"
        key = (e.run, outcome, e.reason)
        self.points[key] = self.points.get(key, 0) + 1
        if e.seconds is not None:
            self.durations.setdefault((e.run, outcome), Histogram(POINT_BUCKETS)).observe(e.seconds)


class _Saved(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    points: list[tuple[str, str, str, int]] = []
    durations: list[tuple[str, str, list[int], float]] = []
    pins: list[tuple[str, list[int], float]] = []
    unreadable: int = 0
    folded: list[str] = []


def _histogram(buckets: tuple[float, ...], counts: list[int], total: float) -> Histogram:
    if len(counts) != len(buckets):
        raise ValueError(f"a histogram has {len(counts)} buckets, not {len(buckets)}")
    return Histogram(buckets, counts, total)


def _load(root: Path) -> tuple[Totals, list[str]]:
    try:
        fd = os.open(root / TOTALS, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return Totals(), []
    except OSError as exc:
        raise TotalsUnreadableError(f"metrics totals {str(root / TOTALS)!r} unreadable: {exc}") from exc
    try:
        with os.fdopen(fd, "rb") as f:
            saved = _Saved.model_validate_json(f.read())
        totals = Totals({(r, o, why): n for r, o, why, n in saved.points},
                        {(r, o): _histogram(POINT_BUCKETS, c, t) for r, o, c, t in saved.durations},
                        {fl: _histogram(PIN_BUCKETS, c, t) for fl, c, t in saved.pins}, saved.unreadable)
    except (OSError, ValidationError, ValueError) as exc:
        first = str(exc).splitlines()[0]
        raise TotalsUnreadableError(f"metrics totals {str(root / TOTALS)!r} unreadable ({first}); move it aside "
                                    "to restart the counts from the events still in events/") from exc
    return totals, saved.folded


def _save(root: Path, totals: Totals, folded: list[str]) -> None:
    saved = _Saved(points=[(*k, n) for k, n in sorted(totals.points.items())],
                   durations=[(*k, h.counts, h.total) for k, h in sorted(totals.durations.items())],
                   pins=[(k, h.counts, h.total) for k, h in sorted(totals.pins.items())],
                   unreadable=totals.unreadable, folded=folded)
    tmp = root / f".tmp-{TOTALS}"
    tmp.unlink(missing_ok=True)  # a crashed fold's; we hold the lock
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, saved.model_dump_json().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, root / TOTALS)
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)  # the rename is durable before any event file is removed
    finally:
        os.close(dfd)


def _remove(path: Path) -> bool:
    """Remove a folded event file; False when it is still there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _read_event(path: Path) -> PointEvent:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        return PointEvent.model_validate_json(f.read(_MAX_EVENT))


def fold(root: Path, on_unreadable: Callable[[str, Exception], None],
         on_orphan: Callable[[str], None] | None = None) -> Totals:
    """Fold the new event files of `root/events` into `root/totals.json` and return the totals
    (steps in the module docstring); `on_unreadable(name, error)` for an event that cannot be
    read (counted in `unreadable`, removed like the others); the temp files of dead writers are
    removed, never counted (`sweep_temps`, `on_orphan(name)` for each)."""
    events = root / EVENTS
    lock = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        totals, folded = _load(root)
        sweep_temps(events, on_orphan)
        folded = [name for name in folded if not _remove(events / name)]
        skip = set(folded)
        new: list[str] = []
        for name in sorted(os.listdir(events)):
            if name.startswith(".") or name in skip:
                continue
            try:
                totals.add(_read_event(events / name))
            except (OSError, ValidationError) as exc:
                totals.unreadable += 1
                on_unreadable(name, exc)
            new.append(name)
        if new:
            _save(root, totals, folded + new)
            for name in new:
                _remove(events / name)
        return totals
    finally:
        os.close(lock)  # releases the flock
