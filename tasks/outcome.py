"""A point's outcome, recorded once for every path that ends it: the flow, its `on_crashed` hook
and the janitor.

- `record_measured`: the point's metrics (`pinned_eval.scoring.metrics.point_metrics` plus the
  datasets run and not due, and the `eval.delegate` metrics) on every dataset's ledger row (a
  point of delegates alone, no dataset due: on one point-level row, `dataset` null), the
  exporters (`tasks.log`), the `measured` and `regressed` events (`tasks.alerts`), and the run's
  Completed state whose message names each score, the datasets not due, the regressions and the failed exporters;
- `record_skipped`: a WARNING naming the point, its `skipped` ledger row and exporters (when the
  sinks block loaded), the `skipped` event, and a Completed state named "Skipped" with the
  reason as message;
- `record_failed`: the `failed` event first (so the alert goes out even when recording fails),
  then (hook, janitor) the retire of the owned snapshot, then the `skipped_crashed` ledger row and
  the exporters (`export=False`: the ledger row only, for the `on_crashed` hook, which runs
  outside any flow run); nothing recorded without a sinks block;
- `retire_owned`: retire the point's snapshot (the one it exported, or the owned one the trainer
  handed over), keeping the run's best `keep_best` steps ranked from the ledger
  (`StagingBlock.protected_steps`). Without a ledger to rank from, keep-best raises ValueError
  before anything is retired; `lenient` (the janitor) logs it and retires deleting nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prefect import get_run_logger
from prefect.states import Completed, State

from blocks import EvalSuiteBlock, SinksBlock, StagingBlock
from pinned_eval.points import SnapshotSource, flow_run_name
from pinned_eval.prometheus import point_ended
from pinned_eval.scoring.metrics import point_metrics
from pinned_eval.sinks import Ledger, MetricRow
from pinned_eval.skips import EvalSkipped, SkipReason
from pinned_eval.snapshot.staging import RetireResult, Staging
from tasks.alerts import emit_failed, emit_measured, emit_point_measured, emit_skipped
from tasks.log import log_point, measured_rows, sink_note, skip_rows
from tasks.measure import Measured
from tasks.progress import lag_steps
from tasks.snapshots import Snapshot, retire_snapshot


def record_measured(
    run: str,
    step: int,
    measured: Measured,
    not_due: list[str],
    suite: EvalSuiteBlock,
    sinks: SinksBlock,
    *,
    started: float,
    export_time_seconds: float | None,
) -> State:
    """`started`: the flow's `time.monotonic()` at its start (for `eval/duration_seconds`)."""
    per_dataset = measured.per_dataset
    seconds = time.monotonic() - started
    point_ended(run, "measured", "", seconds)  # first: the count never waits on (or depends on) a sink
    point = point_metrics(step, lag_steps(run, step), seconds, export_time_seconds)
    point.update({"eval/datasets_run": float(len(per_dataset)), "eval/datasets_not_due": float(len(not_due))})
    delegated = measured.delegated or {}
    point.update(delegated)  # eval.delegate metrics: point-level (tasks.measure refused clashes)
    rows = measured_rows(run, step, per_dataset, point) or [  # delegates alone: one point-level row
        MetricRow(run=run, step=step, state="measured", weight_version=str(step), metrics=point)]
    sink_errors = log_point(run, step, rows, sinks, measured.samples)
    regressed = emit_measured(run, step, per_dataset, suite.regression, sinks.jsonl_path)
    if not per_dataset:
        emit_point_measured(run, step, rows[0].metrics)
    summary = "; ".join(filter(None, [", ".join(f"{ds}={m[f'eval/{ds}']:.3f}" for ds, m in per_dataset.items()),
                                      f"{len(delegated)} delegate metrics" if delegated else ""]))
    summary += f" (not due: {', '.join(not_due)})" if not_due else ""
    summary += f"; regressed: {', '.join(r.dataset for r in regressed)}" if regressed else ""
    return Completed(message=f"measured {flow_run_name(run, step)}: {summary}{sink_note(sink_errors)}")


def record_skipped(
    run: str, step: int, skip: EvalSkipped, sinks: SinksBlock | None, *, started: float | None = None
) -> State:
    """`started`: the flow's `time.monotonic()` at its start (the duration histogram), if known."""
    point_ended(run, "skipped", str(skip.reason), time.monotonic() - started if started is not None else None)
    get_run_logger().warning("skipped %s: %s", flow_run_name(run, step), skip)
    sink_errors = {}
    if sinks is not None:
        sink_errors = log_point(run, step, skip_rows(run, step, skip.reason, skip.message), sinks)
    emit_skipped(run, step, skip.reason, skip.message)
    return Completed(name="Skipped", message=f"{skip.reason}: {skip.message}{sink_note(sink_errors)}")


def record_failed(
    run: str,
    step: int,
    message: str,
    sinks: SinksBlock | Callable[[], SinksBlock] | None,
    *,
    flow_run_id: str | None = None,
    export: bool = True,
    retire: Callable[[SinksBlock], object] | None = None,
    seconds: float | None = None,
) -> None:
    """`sinks`: the block, or how to load it (after the event: a block that fails to load does not
    stop the alert). `flow_run_id`: the point's flow run, when recorded outside it (hook, janitor).
    `retire`: run between the event and the record (hook, janitor), so a visible record means the
    snapshot was retired; the record is written even when it raises (then it propagates).
    `seconds`: how long the point ran, when known (the duration histogram)."""
    emit_failed(run, step, message, flow_run_id=flow_run_id)
    point_ended(run, "failed", str(SkipReason.CRASHED), seconds)
    block = sinks() if callable(sinks) else sinks
    if block is None:  # the sinks block itself failed to load: nowhere to record
        return
    try:
        if retire is not None:
            retire(block)
    finally:
        rows = skip_rows(run, step, SkipReason.CRASHED, message, failed=True)
        if export:
            log_point(run, step, rows, block, flow_run_id=flow_run_id)
        elif block.jsonl_path:
            Ledger(block.jsonl_path).write_point([r.model_copy(update={"flow_run_id": flow_run_id}) for r in rows])


def owned_snapshot(source: SnapshotSource | None, store: Staging, run: str, step: int) -> Snapshot | None:
    """An owned source is its point's from the start: a point that fails before its export task
    (busy, a bad dataset row) still retires the staged snapshot the trainer handed over."""
    if source is None or not source.owned:
        return None
    return Snapshot(path=store.path_for(run, step), owned=True, kind=source.kind)


def keep_best_protection(
    staging: StagingBlock, run: str, jsonl_path: str | None, *, lenient: bool = False
) -> frozenset[int] | None:
    """The steps a retire of `run` keeps beyond the ring (None without keep_best); `lenient`: None
    (the retire deletes nothing) instead of ValueError when keep_best has no ledger, logged."""
    try:
        return staging.protected_steps(run, jsonl_path)
    except ValueError as exc:
        if not lenient:
            raise
        get_run_logger().error("janitor: %s: nothing of run %s deleted", exc, run)
        return None


def retire_owned(
    staging: StagingBlock,
    jsonl_path: str | None,
    run: str,
    step: int,
    *,
    snapshot: Snapshot | None = None,
    source: SnapshotSource | None = None,
    store: Staging | None = None,
    as_task: bool = True,
    lenient: bool = False,
) -> RetireResult | None:
    """Retire `snapshot`, else the owned snapshot of `source` at (run, step); None when there is
    none. `as_task`: through the `retire` task (inside a flow run; a path refused by staging is
    logged there), else directly (the hook, the janitor: `StagingPathError` propagates)."""
    store = store or staging.staging()
    snapshot = snapshot or owned_snapshot(source, store, run, step)
    if snapshot is None:
        return None
    protect = keep_best_protection(staging, run, jsonl_path, lenient=lenient)
    if as_task:
        return retire_snapshot(snapshot, store, protect)
    return store.retire(snapshot.path, owned=snapshot.owned, protect=protect)
