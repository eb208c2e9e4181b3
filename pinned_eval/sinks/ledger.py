"""The ledger: the JSONL record of every point, the one sink other modules read back.

The log task writes it first (its failure fails the task), then the exporters
(`pinned_eval.sinks.export_all`). Everything that needs a point's outcome after the fact reads
the ledger and nothing else: keep-best (`blocks.staging.StagingBlock.protected_steps`), the
regression alert (`tasks.alerts`), the history artifact (`tasks.artifacts`), `pinned-eval
history`, the trainer's outcomes (`trainer_integration.outcomes`) and `pinned-eval rescore`.

A point's record is one row per dataset (measured) or one row with `dataset = None` (skipped or
crashed). Writing a point replaces every earlier row of the same (run, step) for every reader, so
a rerun replaces, never duplicates; rows of other points are untouched. The file is append-only:
a write appends its rows as one framed group (`ledger_file`: one `write`, fsync'd, under an
exclusive flock of `<file>.lock`, so concurrent points in separate processes lose nothing) and
readers return, for each point, the rows of its last complete write (plus the unframed rows after
it: files written before the framing read exactly as before). A write costs what it writes: the
file is not read. `update_point` reads the file backwards to the point's last complete write and
scans from there, so a note on a point written lately costs the file's tail. Readers take no
lock that can wait: a write in flight, or one a crash cut short, is never read as a point's rows.

When a write takes the file past 8 MiB x 2^k, it looks at how much of the file is dead (rows a
later write replaced); more than half, and the file is compacted (temp file + fsync + rename under
the lock: a crash keeps the old file). Each compaction at least halves the file, so it is paid
for by the writes that made the dead half: a write's amortised cost stays what it writes.

A line that is not a metric row (corrupt, truncated, not UTF-8, another format, part of a write a
crash cut short) belongs to no point: readers skip it and compaction keeps it byte for byte where
it was, each time with a warning naming the file and line (`Ledger.bad_lines`). So one bad line
never blocks or loses another run's rows, and nothing is deleted that an operator may want to
look at.

`sink_errors` on a row: the exporters (W&B, Prefect artifacts, the samples file) that failed for
this point, exporter name -> error; the point's state is unchanged by them (`tasks.log`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.sinks.ledger_file import HEAD, Scan, append, compact, count_lines, last_write_of, locked, snapshot

log = logging.getLogger(__name__)
COMPACT_MIN_BYTES = 8 << 20  # a file smaller than this is never compacted


class MetricRow(BaseModel):
    """One sink row: a dataset of a measured point, or the point-level row of a skip."""

    model_config = ConfigDict(extra="forbid")

    run: str
    step: int
    dataset: str | None = None
    state: Literal["measured", "skipped", "failed"]
    reason: str | None = None
    weight_version: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    flow_run_id: str | None = None
    logged_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    sink_errors: dict[str, str] = Field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int, str | None]:
        return (self.run, self.step, self.dataset)

    def to_line(self) -> bytes:
        """The row as one JSONL line (`sink_errors` only when there are some)."""
        exclude = None if self.sink_errors else {"sink_errors"}
        return self.model_dump_json(exclude=exclude).encode() + b"\n"


class Ledger:
    """The point ledger: a JSONL file of metric rows, one set per (run, step) read back."""

    def __init__(self, path: str | Path, *, compact_min_bytes: int = COMPACT_MIN_BYTES) -> None:
        self.path = Path(path)
        self.compact_min_bytes = compact_min_bytes
        self.bad_lines: list[str] = []  # `<file>:<line>: <problem>` of the last read, update or compaction

    def _scan(self, wanted: Callable[[str, int], bool] | None = None, *, settled: bool = False) -> Scan:
        """One pass over the file (`ledger_file.Scan`); `settled`: called under the exclusive lock.
        `wanted(run, step)`: a line this module wrote (its run and step first) of a point not
        wanted is passed over unparsed; every other line is parsed."""
        scan = Scan(self.path, MetricRow.model_validate_json, wanted, keep_raw=settled)
        if settled:
            if self.path.exists():
                with open(self.path, "rb") as f:
                    scan.run(f, os.fstat(f.fileno()).st_size, True)
        else:
            with snapshot(self.path) as snap:
                if snap is not None:
                    scan.run(*snap)
        self.bad_lines = scan.bad
        return scan

    def read(
        self, run: str | None = None, *, steps: Collection[int] | None = None, min_step: int | None = None
    ) -> list[MetricRow]:
        """The rows of every point (of `run`; of `steps`; at or after `min_step`) as its last
        write left them, in file order; lines that are not rows are skipped (`bad_lines`). With a
        filter, the lines of other points are passed over without being parsed, so a read of a few
        steps costs a scan of the file's bytes, not a parse of every row; a bad line is noted
        unless its start names a point not read."""

        def keep(r: str, step: int) -> bool:
            return ((run is None or r == run) and (steps is None or step in steps)
                    and (min_step is None or step >= min_step))  # fmt: skip

        filtered = run is not None or steps is not None or min_step is not None
        rows = cast(list[MetricRow], self._scan(keep if filtered else None).rows())
        return [row for row in rows if keep(row.run, row.step)]

    def write_point(self, rows: list[MetricRow]) -> None:
        """Replace every row of the points in `rows` with `rows`: one append, fsync'd, under the
        exclusive lock; the file is not read (but for a compaction, see the module docstring)."""
        if not rows:
            return
        with locked(self.path):
            self.bad_lines = []
            self._append(rows)

    def update_point(self, run: str, step: int, change: Callable[[list[MetricRow]], list[MetricRow] | None]) -> bool:
        """Under the ledger's lock, replace the rows of point (`run`, `step`) with `change(rows)`;
        nothing is written (False) when the point has no row or `change` returns None. The read
        (of that point's lines only) and the write are one step: a point written meanwhile by
        another process is the one `change` sees."""
        with locked(self.path):
            found = self._point_rows(run, step)
            rows = [r for r in cast(list[MetricRow], found) if (r.run, r.step) == (run, step)]
            changed = change(rows) if rows else None
            if changed is None:
                return False
            self._append(changed)
            return True

    def _point_rows(self, run: str, step: int) -> list[object]:
        """The point's rows, under the lock: scanned from its last complete write (found reading
        the file backwards), so a point written lately costs the file's tail, not its length."""
        wanted = (run, step)
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = last_write_of(f, size, lambda line: _head_point(line) == wanted)
            scan = Scan(self.path, MetricRow.model_validate_json, lambda r, s: (r, s) == wanted)
            if start:
                scan.lines_before = functools.cache(lambda: count_lines(self.path, start))
            f.seek(start or 0)
            scan.run(f, size - (start or 0), True)
        self.bad_lines = scan.bad
        return list(scan.rows())

    def compact(self) -> bool:
        """Rewrite the file without its dead lines, if it has any (True then); under the exclusive
        lock, a crash keeps the old file. Writes do it themselves when it pays (module docstring)."""
        with locked(self.path):
            return self._compact(share=0.0)

    def _compact(self, share: float) -> bool:
        """Compact when the dead lines are more than `share` of the file (under the lock)."""
        if not self.path.exists():
            return False
        scan = self._scan(settled=True)
        size = self.path.stat().st_size
        if scan.dead_bytes <= share * size:
            return False
        compact(scan)
        log.info("%s: compacted, %d of %d bytes were dead", self.path, scan.dead_bytes, size)
        return True

    def _append(self, rows: list[MetricRow]) -> None:
        """Append `rows` as one write; when the file's size crosses `compact_min_bytes` x 2^k, see
        whether it is worth compacting (a full scan, so at most once per doubling)."""
        before, after = append(self.path, [row.to_line() for row in rows])
        unit = self.compact_min_bytes
        if after >= unit and (after // unit).bit_length() > (before // unit).bit_length():
            self._compact(share=0.5)


def _head_point(line: bytes) -> tuple[str, int] | None:
    head = HEAD.match(line)
    if head is None:
        return None
    try:
        return json.loads(head[1]), int(head[2])
    except ValueError:
        return None


JsonlSink = Ledger  # the name it had before it was recognised as the ledger; kept for imports
