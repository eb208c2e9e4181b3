"""Log task: one point's record into the ledger, then into every exporter.

Contract: a measured point writes one row per dataset, a skipped/failed point one point-level row
with `eval/skipped_<reason>: 1`; every row is at the point's step.

Nothing is lost to an exporter: the ledger (`pinned_eval.sinks.Ledger`, the sinks block's
`jsonl_path`) is written first and is the record (its own failure fails the task). The exporters
configured for the block come after it, chosen through the one registry
(`pinned_eval.sinks.EXPORTERS`, one module per tracker, in order: the samples file `results`, the
`samples` artifact, `wandb`, `mlflow`, `tensorboard`, the point's `artifacts`), each retried
(`SINK_ATTEMPTS`, exponential backoff), each declaring its own lock (`exclusive`, held here with
`tasks.admission.exclusive`). An exporter that still fails does not change the point's outcome:
`log_point` returns {exporter: error}, logs a WARNING naming it and the error, and rewrites the
point's ledger rows with `sink_errors` and `eval/sink_failed_<exporter>: 1`; the flow adds
`sink_note(...)` to the run's state message. Only `Exception`s are caught (a cancellation or
deadline still unwinds). A W&B, MLflow or TensorBoard retry after a partial write may log the same
values twice at the same step.

Under `pinned-eval worker` the remote trackers (W&B, MLflow: `Exporter.deferrable`) leave the
point's path: their parcels go into the worker's outbox and its deliverer sends them
(`pinned_eval.sinks.outbox`), noting a failure in the same ledger rows later; the state message
then names them as handed over, not their result. Outside a worker (or while no deliverer
serves it) every exporter runs here.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context

from blocks.sinks import SinksBlock
from pinned_eval.scoring.metrics import skip_metrics
from pinned_eval.sinks import (
    SINK_ATTEMPTS,
    Ledger,
    MetricRow,
    PointRecord,
    PointSamples,
    build_exporters,
    close_all,
    export_all,
    with_sink_errors,
)
from pinned_eval.sinks.outbox import defer
from tasks import artifacts, results  # noqa: F401 - importing them registers their exporters
from tasks.admission import exclusive
from tasks.progress import lag_steps

SinkName = str  # an exporter's name: "results" | "samples" | "wandb" | "mlflow" | "tensorboard" | "artifacts"


def _flow_run_id() -> str | None:
    ctx = get_run_context()
    flow_run = getattr(ctx, "flow_run", None) or getattr(getattr(ctx, "task_run", None), "flow_run_id", None)
    return str(getattr(flow_run, "id", flow_run)) if flow_run else None


@task(cache_policy=NO_CACHE, task_run_name="log-{run}-{step}")
def log_point(
    run: str,
    step: int,
    rows: list[MetricRow],
    sinks: SinksBlock,
    samples: PointSamples | None = None,
    flow_run_id: str | None = None,
) -> dict[SinkName, str]:
    """Record the point in the ledger and every exporter; returns the exporters that failed after
    their retries. `flow_run_id`: the point's flow run (default: the one this task runs in)."""
    logger = get_run_logger()
    flow_run_id = flow_run_id or _flow_run_id()
    record = PointRecord(
        run, step, [r.model_copy(update={"flow_run_id": flow_run_id}) for r in rows], flow_run_id, samples
    )
    ledger = Ledger(sinks.jsonl_path) if sinks.jsonl_path else None
    if ledger is not None:
        ledger.write_point(record.rows)
        for problem in ledger.bad_lines:
            logger.warning("JSONL sink: %s; kept as is, other rows unaffected", problem)
    exporters = build_exporters(sinks)
    try:
        inline, deferred, errors = defer(exporters, record, sinks.jsonl_path)
        if deferred:
            logger.info("%s/step-%d: %s handed to the worker's deliverer", run, step, ", ".join(deferred))
        errors |= export_all(inline, record, hold=exclusive)
    finally:
        close_all(exporters)
    for sink, error in errors.items():
        logger.warning(
            "sink %s failed for %s/step-%d after %d attempts; the point keeps its outcome: %s",
            sink,
            run,
            step,
            SINK_ATTEMPTS,
            error,
        )
    if errors and ledger is not None:  # merged with what the deliverer may have noted already
        ledger.update_point(run, step, lambda rows: [with_sink_errors(r, errors) for r in rows])
    logger.info("logged %s/step-%d: %s", run, step, record.rows[0].state)
    return errors


def sink_note(errors: dict[SinkName, str]) -> str:
    """What a run's state message says about failed sinks ("" when none failed)."""
    if not errors:
        return ""
    return "; sink failed: " + "; ".join(f"{sink} ({error[:200]})" for sink, error in sorted(errors.items()))


def measured_rows(
    run: str, step: int, per_dataset: dict[str, dict[str, float]], point: dict[str, float]
) -> list[MetricRow]:
    version = str(step)
    return [
        MetricRow(run=run, step=step, dataset=ds, state="measured", weight_version=version, metrics={**m, **point})
        for ds, m in per_dataset.items()
    ]


def skip_rows(run: str, step: int, reason: str, message: str, *, failed: bool = False) -> list[MetricRow]:
    return [
        MetricRow(
            run=run,
            step=step,
            state="failed" if failed else "skipped",
            reason=reason,
            metrics={**skip_metrics(step, reason), "eval/lag_steps": float(lag_steps(run, step))},
        )
    ]
