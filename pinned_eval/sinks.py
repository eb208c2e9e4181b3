"""Metric sinks without Prefect: the JSONL file and W&B beside the training run.

A point's record is one row per dataset (measured) or one row with `dataset = None` (skipped or
crashed). Writing a point replaces every earlier row of the same (run, step), so a rerun
replaces, never duplicates; rows of other points are untouched. The file is rewritten through a
temp file + rename under an exclusive lock, so readers never see a half-written file and
concurrent points (separate processes) do not lose each other's rows.

A line that is not a metric row (corrupt, truncated, not UTF-8, another format) belongs to no
point: readers skip it and a rewrite keeps it byte for byte where it was, each time with a
warning naming the file and line (`JsonlSink.bad_lines`). So one bad line never blocks or loses
another run's rows, and nothing is deleted that an operator may want to look at.

`sink_errors` on a row: the sinks after the JSONL file (W&B, Prefect artifacts) that failed for
this point, sink name -> error; the point's state is unchanged by them (`tasks.log`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.durable import replace_durably

log = logging.getLogger(__name__)


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


class JsonlSink:
    """Metrics file with one JSON row per (run, step, dataset)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.bad_lines: list[str] = []  # `<file>:<line>: <problem>` of the last read or write

    def _lines(self) -> Iterator[tuple[bytes, MetricRow | None]]:
        """Every non-blank line with its row, or None (warned and noted) when it is not one."""
        self.bad_lines = []
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    row = MetricRow.model_validate_json(raw)
                except ValueError as exc:  # not JSON, not UTF-8, not a metric row
                    problem = str(exc).splitlines()[0][:200]
                    self.bad_lines.append(f"{self.path}:{lineno}: not a metric row ({problem})")
                    log.warning("%s:%d: not a metric row, skipped and kept as is: %s", self.path, lineno, problem)
                    row = None
                yield raw, row

    def read(self, run: str | None = None) -> list[MetricRow]:
        """Every row (of `run`), in file order; lines that are not rows are skipped (`bad_lines`)."""
        return [row for _, row in self._lines() if row is not None and (run is None or row.run == run)]

    def write_point(self, rows: list[MetricRow]) -> None:
        """Replace every row of the points in `rows` with `rows` (atomically); other lines,
        unparseable ones included, are kept byte for byte."""
        if not rows:
            return
        points = {(r.run, r.step) for r in rows}
        with _locked(self.path):
            kept = [
                raw if raw.endswith(b"\n") else raw + b"\n"
                for raw, row in self._lines()
                if row is None or (row.run, row.step) not in points
            ]
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.writelines([*kept, *(row.to_line() for row in rows)])
            replace_durably(tmp, self.path)


WandbWriter = Literal["eval_run", "shared"]


def wandb_eval_run_id(training_run_id: str) -> str:
    """The dedicated eval run of a training run (writer `eval_run`), grouped with it."""
    return f"{training_run_id}-eval"


_QUIET: dict[str, Any] = {"silent": True, "x_disable_stats": True, "console": "off"}


def shared_writer_settings(label: str) -> Any:
    """W&B settings of a secondary writer into a live run (shared mode, online only): labelled
    `label`, not the primary (no run files of its own), and its finish leaves the run running."""
    import wandb

    return wandb.Settings(mode="shared", x_label=label, x_primary=False, x_update_finish_state=False, **_QUIET)


def log_to_wandb(
    metrics: dict[str, float],
    *,
    project: str,
    run_id: str,
    entity: str | None,
    mode: str,
    directory: str | None,
    writer: WandbWriter = "eval_run",
    label: str = "pinned-eval",
    tables: Mapping[str, tuple[list[str], list[list[Any]]]] | None = None,
) -> None:
    """Log one point's metrics beside the training run `run_id`, on the `eval/step` axis.

    `tables`: W&B tables logged with the metrics, name -> (columns, rows) (the point's samples).

    `eval_run`: into the dedicated run `wandb_eval_run_id(run_id)` (`group=run_id`,
    `job_type="eval"`), created by the first point and resumed by id by later ones; the training
    run itself is never resumed. `shared` (online only): into the live training run through W&B's
    shared mode, as a secondary writer (`x_primary=False`, labelled `label`) whose finish leaves
    the run's state alone. Either way every `eval/*` metric is plotted against `eval/step`.
    """
    import wandb  # wandb: optional extra, slow import

    if writer == "shared":
        wb = wandb.init(project=project, entity=entity, id=run_id, dir=directory, reinit="create_new",
                        settings=shared_writer_settings(label))
    else:
        wb = wandb.init(
            project=project,
            entity=entity,
            id=wandb_eval_run_id(run_id),
            resume="allow",
            group=run_id,
            job_type="eval",
            mode=mode,  # type: ignore[arg-type]
            dir=directory,
            reinit="create_new",
            settings=wandb.Settings(**_QUIET),
        )
    try:
        wb.define_metric("eval/step")
        wb.define_metric("eval/*", step_metric="eval/step")
        logged: dict[str, Any] = dict(metrics)
        for name, (columns, data) in (tables or {}).items():
            logged[name] = wandb.Table(columns=list[str | int](columns), data=data)
        wb.log(logged)
    finally:
        wb.finish()
