"""The ledger: the JSONL record of every point, the one sink other modules read back.

The log task writes it first (its failure fails the task), then the exporters
(`pinned_eval.sinks.export_all`). Everything that needs a point's outcome after the fact reads
the ledger and nothing else: keep-best (`blocks.staging.StagingBlock.protected_steps`), the
regression alert (`tasks.alerts`), the history artifact (`tasks.artifacts`), `pinned-eval
history`, the trainer's outcomes (`trainer_integration.outcomes`) and `pinned-eval rescore`.

A point's record is one row per dataset (measured) or one row with `dataset = None` (skipped or
crashed). Writing a point replaces every earlier row of the same (run, step), so a rerun
replaces, never duplicates; rows of other points are untouched. The file is rewritten through a
temp file + rename under an exclusive lock, so readers never see a half-written file and
concurrent points (separate processes) do not lose each other's rows.

A line that is not a metric row (corrupt, truncated, not UTF-8, another format) belongs to no
point: readers skip it and a rewrite keeps it byte for byte where it was, each time with a
warning naming the file and line (`Ledger.bad_lines`). So one bad line never blocks or loses
another run's rows, and nothing is deleted that an operator may want to look at.

`sink_errors` on a row: the exporters (W&B, Prefect artifacts, the samples file) that failed for
this point, exporter name -> error; the point's state is unchanged by them (`tasks.log`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.durable import replace_durably

log = logging.getLogger(__name__)
# the start of a line `MetricRow.to_line` wrote: its run (a JSON string) and step, in that order
_HEAD = re.compile(rb'\{"run":("(?:[^"\\]|\\.)*"),"step":(-?\d+)[,}]')


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


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Ledger:
    """The point ledger: a JSONL file with one metric row per (run, step, dataset)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.bad_lines: list[str] = []  # `<file>:<line>: <problem>` of the last read or write

    def _lines(self, wanted: Callable[[str, int], bool] | None = None) -> Iterator[tuple[bytes, MetricRow | None]]:
        """Every non-blank line with its row, or None (warned and noted) when it is not one.

        `wanted(run, step)`: a line this module wrote (`_HEAD`: its run and step first) of a
        point not wanted is passed over unparsed; every other line is parsed as before."""
        self.bad_lines = []
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                if wanted is not None and (head := _HEAD.match(raw)) is not None:
                    try:
                        run, step = json.loads(head[1]), int(head[2])
                    except ValueError:
                        pass
                    else:
                        if not wanted(run, step):
                            continue
                try:
                    row = MetricRow.model_validate_json(raw)
                except ValueError as exc:  # not JSON, not UTF-8, not a metric row
                    problem = str(exc).splitlines()[0][:200]
                    self.bad_lines.append(f"{self.path}:{lineno}: not a metric row ({problem})")
                    log.warning("%s:%d: not a metric row, skipped and kept as is: %s", self.path, lineno, problem)
                    row = None
                yield raw, row

    def read(
        self, run: str | None = None, *, steps: Collection[int] | None = None, min_step: int | None = None
    ) -> list[MetricRow]:
        """Every row (of `run`; of `steps`; at or after `min_step`), in file order; lines that are
        not rows are skipped (`bad_lines`). With a filter, the lines of other points are passed
        over without being parsed (`_lines`), so a read of a few steps costs a scan of the file's
        bytes, not a parse of every row; a bad line is noted unless its start names a point not
        read."""

        def keep(r: str, step: int) -> bool:
            return ((run is None or r == run) and (steps is None or step in steps)
                    and (min_step is None or step >= min_step))  # fmt: skip

        filtered = run is not None or steps is not None or min_step is not None
        lines = self._lines(keep if filtered else None)
        return [row for _, row in lines if row is not None and keep(row.run, row.step)]

    def write_point(self, rows: list[MetricRow]) -> None:
        """Replace every row of the points in `rows` with `rows` (atomically); other lines,
        unparseable ones included, are kept byte for byte."""
        if not rows:
            return
        with _locked(self.path):
            self._rewrite({(r.run, r.step) for r in rows}, rows)

    def update_point(self, run: str, step: int, change: Callable[[list[MetricRow]], list[MetricRow] | None]) -> bool:
        """Under the ledger's lock, replace the rows of point (`run`, `step`) with `change(rows)`;
        nothing is written (False) when the point has no row or `change` returns None. The read
        and the write are one step: a point written meanwhile by another process is the one
        `change` sees."""
        with _locked(self.path):
            rows = [row for _, row in self._lines(lambda r, s: (r, s) == (run, step))
                    if row is not None and (row.run, row.step) == (run, step)]
            changed = change(rows) if rows else None
            if changed is None:
                return False
            self._rewrite({(run, step)}, changed)
            return True

    def _rewrite(self, points: set[tuple[str, int]], rows: list[MetricRow]) -> None:
        """The file without the rows of `points`, then `rows`; called under the lock."""
        kept = [
            raw if raw.endswith(b"\n") else raw + b"\n"
            for raw, row in self._lines()
            if row is None or (row.run, row.step) not in points
        ]
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.writelines([*kept, *(row.to_line() for row in rows)])
        replace_durably(tmp, self.path)


JsonlSink = Ledger  # the name it had before it was recognised as the ledger; kept for imports
