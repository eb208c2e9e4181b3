"""Metric sinks without Prefect: the JSONL file and W&B beside the training run.

A point's record is one row per dataset (measured) or one row with `dataset = None` (skipped or
crashed). Writing a point replaces every earlier row of the same (run, step), so a rerun
replaces, never duplicates; rows of other points are untouched. The file is rewritten through a
temp file + rename under an exclusive lock, so readers never see a half-written file and
concurrent points (separate processes) do not lose each other's rows.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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

    @property
    def key(self) -> tuple[str, int, str | None]:
        return (self.run, self.step, self.dataset)


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

    def read(self, run: str | None = None) -> list[MetricRow]:
        if not self.path.exists():
            return []
        rows = []
        with open(self.path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = MetricRow.model_validate_json(line)
                except ValueError as exc:
                    raise ValueError(f"{self.path}:{lineno}: not a metric row: {exc}") from exc
                if run is None or row.run == run:
                    rows.append(row)
        return rows

    def write_point(self, rows: list[MetricRow]) -> None:
        """Replace every row of the points in `rows` with `rows` (atomically)."""
        if not rows:
            return
        points = {(r.run, r.step) for r in rows}
        with _locked(self.path):
            kept = [r for r in self.read() if (r.run, r.step) not in points]
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                for row in [*kept, *rows]:
                    f.write(row.model_dump_json() + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)


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
) -> None:
    """Log one point's metrics beside the training run `run_id`, on the `eval/step` axis.

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
        wb.log(metrics)
    finally:
        wb.finish()
