"""Log task: one point's record into every sink — JSONL, W&B, and Prefect artifacts.

Contract: a measured point writes one row per dataset, a skipped/failed point one point-level row
with `eval/skipped_<reason>: 1`; every row is at the point's step.

Nothing is lost to a sink: the JSONL file is written first and is the record (its own failure
fails the task). W&B and the artifacts come after it, each retried (`attempt_sink`:
`SINK_ATTEMPTS`, exponential backoff); a sink that still fails does not change the point's
outcome: `log_point` returns {sink: error}, logs a WARNING naming the sink and the error, and
rewrites the point's JSONL rows with `sink_errors` and `eval/sink_failed_<sink>: 1`; the flow adds
`sink_note(...)` to the run's state message. The per-sample artifact (`samples`, written by the
score task before this one) follows the same rule: the score task logs its error and marks the
rows `eval/sink_failed_samples: 1`, which `log_point` reports with the others. Only `Exception`s
are caught (a cancellation or deadline still unwinds).
A W&B retry after a partial write may log the same row twice (same `eval/step`, same values).

Artifacts: a table per point (`eval-<run>-step-<step>`) and the run's history table `eval-<run>`
(one row per step, newest record wins) — a new version of it per point. With a JSONL sink the
history is rebuilt from the JSONL file, so it also holds the skips the trainer recorded itself
(`busy`, `export_failed`: no flow ran for them); without one it is the previous version plus this
point. Secrets never enter a
row or an artifact.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

from prefect import get_run_logger, task
from prefect.artifacts import Artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.variables import Variable
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from blocks.sinks import SinksBlock
from pinned_eval.points import history_artifact_key, progress_variable_name
from pinned_eval.results.store import SAMPLES
from pinned_eval.scoring.metrics import skip_metrics
from pinned_eval.sinks import JsonlSink, MetricRow, log_to_wandb, wandb_eval_run_id
from tasks.admission import exclusive


def trainer_step(run: str) -> int | None:
    """The trainer's latest reported step (a Prefect Variable the trainer side updates)."""
    value = Variable.get(progress_variable_name(run), default=None)
    return int(value) if value is not None else None


def lag_steps(run: str, step: int) -> int:
    latest = trainer_step(run)
    return max(latest - step, 0) if latest is not None else 0


def _flow_run_id() -> str | None:
    ctx = get_run_context()
    flow_run = getattr(ctx, "flow_run", None) or getattr(getattr(ctx, "task_run", None), "flow_run_id", None)
    return str(getattr(flow_run, "id", flow_run)) if flow_run else None


def _history_row(rows: list[MetricRow]) -> dict[str, Any]:
    first = rows[0]
    row: dict[str, Any] = {
        "step": first.step,
        "state": first.state,
        "reason": first.reason or "",
        "weight_version": first.weight_version or "",
        "lag_steps": first.metrics.get("eval/lag_steps", ""),
    }
    for r in rows:
        if r.dataset is not None:
            row[f"eval/{r.dataset}"] = round(r.metrics.get(f"eval/{r.dataset}", float("nan")), 4)
    return row


def _update_history(run: str, rows: list[MetricRow], jsonl_path: str | None) -> None:
    key = history_artifact_key(run)
    table: list[dict[str, Any]] = []
    if jsonl_path:
        by_step: dict[int, list[MetricRow]] = {}
        for r in JsonlSink(jsonl_path).read(run):  # this point's rows are already in it
            by_step.setdefault(r.step, []).append(r)
        table = [_history_row(step_rows) for _, step_rows in sorted(by_step.items())]
    else:
        previous = cast(Artifact | None, Artifact.get(key))
        if previous is not None and previous.data:
            raw = json.loads(previous.data) if isinstance(previous.data, str) else previous.data
            data = cast(list[dict[str, Any]], raw)
            table = [r for r in data if r.get("step") != rows[0].step]
        table.append(_history_row(rows))
        table.sort(key=lambda r: r["step"])
    create_table_artifact(table=table, key=key, description=f"eval history of run {run}, one row per step")


SINK_ATTEMPTS = 3  # per sink after the JSONL file; waits 0.5 s, 1 s between attempts
SinkName = str  # "wandb" | "artifacts" | "samples" | "results"
SINK_FAILED = "eval/sink_failed_"


@task(cache_policy=NO_CACHE, task_run_name="log-{run}-{step}")
def log_point(run: str, step: int, rows: list[MetricRow], sinks: SinksBlock) -> dict[SinkName, str]:
    """Record the point in every sink; returns the sinks that failed after their retries."""
    logger = get_run_logger()
    flow_run_id = _flow_run_id()
    rows = [r.model_copy(update={"flow_run_id": flow_run_id}) for r in rows]
    jsonl = JsonlSink(sinks.jsonl_path) if sinks.jsonl_path else None
    if jsonl is not None:
        jsonl.write_point(rows)
        for problem in jsonl.bad_lines:
            logger.warning("JSONL sink: %s; kept as is, other rows unaffected", problem)
    attempts: dict[SinkName, str | None] = {}
    if sinks.wandb_project and sinks.wandb_mode != "disabled":
        project = sinks.wandb_project
        attempts["wandb"] = attempt_sink(lambda: _log_wandb(run, step, rows, sinks, project))
    attempts["artifacts"] = attempt_sink(lambda: _log_artifacts(run, step, rows, sinks))
    errors = {sink: error for sink, error in attempts.items() if error}
    for sink, error in errors.items():
        logger.warning("sink %s failed for %s/step-%d after %d attempts; the point keeps its outcome: %s",
                       sink, run, step, SINK_ATTEMPTS, error)
    if any(f"{SINK_FAILED}samples" in r.metrics for r in rows):  # already logged by the score task
        errors["samples"] = "per-sample artifact not written (the score task's WARNING log has the error)"
    if any(f"{SINK_FAILED}results" in r.metrics for r in rows):  # likewise
        errors["results"] = "samples file not written (the score task's WARNING log has the error)"
    if errors and jsonl is not None:
        jsonl.write_point([_with_sink_errors(r, errors) for r in rows])
    logger.info("logged %s/step-%d: %s", run, step, next(r.state for r in rows))
    return errors


def sink_note(errors: dict[SinkName, str]) -> str:
    """What a run's state message says about failed sinks ("" when none failed)."""
    if not errors:
        return ""
    return "; sink failed: " + "; ".join(f"{sink} ({error[:200]})" for sink, error in sorted(errors.items()))


def attempt_sink(write: Callable[[], None]) -> str | None:
    """Run `write` up to `SINK_ATTEMPTS` times: None once it succeeds, else its last error."""
    retrying = Retrying(
        stop=stop_after_attempt(SINK_ATTEMPTS),
        wait=wait_exponential(multiplier=0.5, max=4.0),
        retry=retry_if_exception_type(Exception),
        reraise=True,
    )
    try:
        for attempt in retrying:
            with attempt:
                write()
    except Exception as exc:  # recorded beside the point (JSONL, log, state message), never dropped
        return f"{type(exc).__name__}: {exc}"
    return None


def _with_sink_errors(row: MetricRow, errors: dict[SinkName, str]) -> MetricRow:
    failed = {f"{SINK_FAILED}{sink}": 1.0 for sink in errors}
    return row.model_copy(update={"sink_errors": dict(errors), "metrics": {**row.metrics, **failed}})


def _log_artifacts(run: str, step: int, rows: list[MetricRow], sinks: SinksBlock) -> None:
    """The point's table; its description links the samples file when the point wrote one."""
    key = f"{history_artifact_key(run)}-step-{step}"
    description = f"eval point {run}/step-{step}"
    store = sinks.results_store()
    if store is not None and rows[0].state == "measured" and store.exists(run, step, SAMPLES):
        description += f"; samples: [{store.url(run, step, SAMPLES)}]({store.link(run, step, SAMPLES)})"
    create_table_artifact(
        table=[{"dataset": r.dataset or "", "state": r.state, "reason": r.reason or "", **r.metrics} for r in rows],
        key=key,
        description=description,
    )
    _update_history(run, rows, sinks.jsonl_path)


def _log_wandb(run: str, step: int, rows: list[MetricRow], sinks: SinksBlock, project: str) -> None:
    """One W&B row per point. The dedicated eval run has one writer at a time (the lock
    `wandb-<eval run id>`, limit 1): concurrent points resume it in turn, never at once."""
    merged: dict[str, float] = {}
    for r in rows:
        merged.update(r.metrics)
    training_run = sinks.wandb_run_id or run
    kwargs: dict[str, Any] = {
        "project": project,
        "run_id": training_run,
        "entity": sinks.wandb_entity,
        "mode": sinks.wandb_mode,
        "directory": sinks.wandb_dir,
        "writer": sinks.wandb_writer,
        "label": f"pinned-eval-{run}-step-{step}",
        "tables": _wandb_sample_tables(run, step, sinks) if rows[0].state == "measured" else {},
    }
    if sinks.wandb_writer == "shared":
        log_to_wandb(merged, **kwargs)
        return
    with exclusive(f"wandb-{wandb_eval_run_id(training_run)}"):
        log_to_wandb(merged, **kwargs)


WANDB_SAMPLE_COLUMNS = ("example_id", "sample_index", "prompt", "response", "reward", "finish_reason",
                        "completion_tokens", "weight_version")  # fmt: skip


def _wandb_sample_tables(run: str, step: int, sinks: SinksBlock) -> dict[str, tuple[list[str], list[list[Any]]]]:
    """`eval/samples/<ds>`: the first `wandb_samples_per_dataset` samples of each dataset (by example id,
    then sample index) from the point's samples file; none without a results store or a count."""
    store = sinks.results_store()
    n = sinks.wandb_samples_per_dataset
    if store is None or n == 0 or not store.exists(run, step, SAMPLES):
        return {}
    tables: dict[str, tuple[list[str], list[list[Any]]]] = {}
    rows = sorted(store.read(run, step, SAMPLES).to_pylist(), key=lambda r: (r["example_id"], r["sample_index"]))
    for r in rows:
        _, data = tables.setdefault(f"eval/samples/{r['dataset']}", (list(WANDB_SAMPLE_COLUMNS), []))
        if len(data) < n:
            data.append([r[c] for c in WANDB_SAMPLE_COLUMNS])
    return tables


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
