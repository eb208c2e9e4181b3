"""The W&B exporter: one W&B row per point beside the training run, plotted against `eval/step`.

Writers (`SinksBlock.wandb_writer`):
- `eval_run`: into the dedicated run `wandb_eval_run_id(run_id)` (`group=run_id`,
  `job_type="eval"`), created by the first point and resumed by id by later ones; the training
  run itself is never resumed. It has one writer at a time: the exporter declares the lock
  `wandb-<eval run id>` (`exclusive`), which the log task holds (limit 1) around each attempt, so
  concurrent points resume it in turn, never at once;
- `shared` (online only): into the live training run through W&B's shared mode, as a secondary
  writer (`x_primary=False`, labelled `pinned-eval-<run>-step-<step>`) whose finish leaves the
  run's state alone; no lock.

A measured point with a results store and `wandb_samples_per_dataset > 0` also logs the tables
`eval/samples/<ds>`: the first N samples of each dataset (by example id, then sample index),
read from the point's samples file; a dataset whose samples carry transcripts (agentic rollouts)
adds the columns `WANDB_TRANSCRIPT_COLUMNS` (messages and tool calls as JSON text). The `wandb`
package is imported only when a point is logged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from pinned_eval.sinks.exporters import (
    BaseExporter,
    Parcel,
    PointRecord,
    SinkSettings,
    plain_config,
    register_exporter,
)

if TYPE_CHECKING:
    from pinned_eval.results.store import ResultsStore

WandbWriter = Literal["eval_run", "shared"]

WANDB_SAMPLE_COLUMNS = (
    "example_id",
    "sample_index",
    "prompt",
    "response",
    "reward",
    "finish_reason",
    "completion_tokens",
    "weight_version",
)

WANDB_TRANSCRIPT_COLUMNS = ("turns", "status", "tool_calls", "messages")


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
    """Log one point's metrics beside the training run `run_id` (see the module docstring).

    `tables`: W&B tables logged with the metrics, name -> (columns, rows) (the point's samples)."""
    import wandb  # wandb: optional extra, slow import

    if writer == "shared":
        wb = wandb.init(
            project=project,
            entity=entity,
            id=run_id,
            dir=directory,
            reinit="create_new",
            settings=shared_writer_settings(label),
        )
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


class WandbConfig(BaseModel):
    """The W&B part of the sinks block (its `wandb_*` fields)."""

    model_config = ConfigDict(frozen=True)

    project: str
    entity: str | None = None
    run_id: str | None = None  # the training run's id; default: the pinned-eval run name
    writer: WandbWriter = "eval_run"
    mode: str = "offline"
    directory: str | None = None
    samples_per_dataset: int = 0

    @classmethod
    def from_settings(cls, settings: SinkSettings) -> WandbConfig | None:
        """None when W&B is off (no project, or mode `disabled`)."""
        if not settings.wandb_project or settings.wandb_mode == "disabled":
            return None
        return cls.model_validate(
            {
                "project": settings.wandb_project,
                "entity": settings.wandb_entity,
                "run_id": settings.wandb_run_id,
                "writer": settings.wandb_writer,
                "mode": settings.wandb_mode,
                "directory": settings.wandb_dir,
                "samples_per_dataset": settings.wandb_samples_per_dataset,
            }
        )


class WandbExporter(BaseExporter):
    """Deferrable: the parcel holds the merged metrics and the sample tables (read from the
    samples file on the point), `send` is one `log_to_wandb`."""

    name = "wandb"
    deferrable = True

    def __init__(self, config: WandbConfig, store: ResultsStore | None) -> None:
        self.config = config
        self.store = store

    def exclusive(self, record: PointRecord) -> str | None:
        if self.config.writer == "shared":
            return None
        return f"wandb-{wandb_eval_run_id(self.config.run_id or record.run)}"

    def parcel(self, record: PointRecord) -> Parcel:
        merged: dict[str, float] = {}
        for r in record.rows:
            merged.update(r.metrics)
        tables = self.sample_tables(record.run, record.step) if record.measured else {}
        body = {"metrics": merged, "run_id": self.config.run_id or record.run,
                "label": f"pinned-eval-{record.run}-step-{record.step}",
                "tables": {name: [columns, data] for name, (columns, data) in tables.items()}}
        return Parcel(exporter=self.name, config=plain_config(self.config), lock=self.exclusive(record), body=body)

    def send(self, parcel: Parcel) -> None:
        body = parcel.body
        log_to_wandb(
            body["metrics"],
            project=self.config.project,
            run_id=body["run_id"],
            entity=self.config.entity,
            mode=self.config.mode,
            directory=self.config.directory,
            writer=self.config.writer,
            label=body["label"],
            tables={name: (columns, data) for name, (columns, data) in body["tables"].items()},
        )

    def sample_tables(self, run: str, step: int) -> dict[str, tuple[list[str], list[list[Any]]]]:
        """`eval/samples/<ds>` from the point's samples file; none without a store, a count or the file."""
        from pinned_eval.results.store import SAMPLES  # pyarrow: slow import, only when a point is logged

        n = self.config.samples_per_dataset
        if self.store is None or n == 0 or not self.store.exists(run, step, SAMPLES):
            return {}
        tables = first_samples(self.store.read(run, step, SAMPLES).to_pylist(), n)
        return {f"eval/samples/{ds}": table for ds, table in tables.items()}


def first_samples(rows: list[dict[str, Any]], n: int) -> dict[str, tuple[list[str], list[list[Any]]]]:
    """Per dataset, (columns, the first `n` samples by example id then sample index) of a point's
    samples rows; a dataset whose samples carry transcripts adds `WANDB_TRANSCRIPT_COLUMNS`."""
    from pinned_eval.results.tables import has_transcript

    tables: dict[str, tuple[list[str], list[list[Any]]]] = {}
    ordered = sorted(rows, key=lambda r: (r["example_id"], r["sample_index"]))
    agentic = {r["dataset"] for r in ordered if has_transcript(r)}
    for r in ordered:
        columns = [*WANDB_SAMPLE_COLUMNS, *(WANDB_TRANSCRIPT_COLUMNS if r["dataset"] in agentic else ())]
        _, data = tables.setdefault(r["dataset"], (columns, []))
        if len(data) < n:
            data.append([r.get(c) for c in columns])
    return tables


def _build(settings: SinkSettings) -> WandbExporter | None:
    config = WandbConfig.from_settings(settings)
    return WandbExporter(config, settings.results_store()) if config is not None else None


def _restore(config: dict[str, Any]) -> WandbExporter:
    return WandbExporter(WandbConfig.model_validate(config), None)


register_exporter("wandb", _build, order=30, restore=_restore)
