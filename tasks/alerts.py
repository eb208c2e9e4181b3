"""Outcome events of the eval-point flow (docs/alerts.md): what automations notify on.

- `pinned-eval.point.measured`: one per dataset measured, payload = its metrics; a point that ran
  only delegates (no dataset due) emits one for the point, payload = its point-level metrics;
- `pinned-eval.point.regressed`: one per measured dataset that the suite block's regression rule
  flags against the run's earlier ledger rows (payload: `Regression`); none without a rule or
  without a ledger (logged);
- `pinned-eval.point.skipped`: one per skipped point (payload: reason, message);
- `pinned-eval.point.failed`: one per failed point (payload: reason `crashed`, the error), from
  whichever path ends it: the flow's own `except` (an error it caught), its `on_crashed` hook (the
  flow-run process died under a live worker), or the janitor's crash of a zombie (the worker or
  host is gone). Exactly one of them ends a run: the hook runs only when the run's Crashed state
  is accepted, the janitor only crashes runs still Running or Pending, through a transition the
  server refuses once the run is terminal.
Resources: `pinned_eval.events.point_resource` (labels run, step, dataset); Prefect relates each
event to the flow run that emitted it, and a `failed` event emitted outside the point's own run
(hook, janitor) names the point's flow run as a related resource (role `flow-run`). An event
emitted outside any run (the hook, a crash outside the janitor flow) relates no other run: Prefect's
events worker keeps the run context it was started in and overrides only the context variables the
emitter has set, so each emit here sets them (`_emit`). Emitting is
queued to Prefect's events worker (drained at process exit) and never changes the point's outcome.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from prefect import get_run_logger
from prefect.context import FlowRunContext, TaskRunContext
from prefect.events import emit_event

from pinned_eval.events import EVENT_FAILED, EVENT_MEASURED, EVENT_REGRESSED, EVENT_SKIPPED, point_resource
from pinned_eval.scoring.regression import Regression, RegressionRule
from pinned_eval.sinks import Ledger


def _emit(event: str, resource: dict[str, str], payload: dict[str, Any], related: list[Any] | None = None) -> None:
    """`emit_event` with the emitter's run context stated in full (None where there is no run), so
    the events worker relates the event to the emitter's runs, never to the flow run it was
    started in (its task's own context, which it keeps for the variables an emitter leaves unset)."""
    run_vars: tuple[ContextVar[Any], ...] = (FlowRunContext.__var__, TaskRunContext.__var__)
    tokens = [(var, var.set(var.get(None))) for var in run_vars]
    try:
        emit_event(event, resource=resource, related=related, payload=payload)
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def emit_measured(
    run: str, step: int, per_dataset: dict[str, dict[str, float]], rule: RegressionRule | None, jsonl_path: str | None
) -> list[Regression]:
    """Emit `measured` per dataset, then `regressed` for those the rule flags; returns the regressions."""
    for ds, metrics in per_dataset.items():
        _emit(EVENT_MEASURED, resource=point_resource(run, step, ds), payload={"metrics": metrics})
    return _regressions(run, step, per_dataset, rule, jsonl_path)


def emit_point_measured(run: str, step: int, metrics: dict[str, float]) -> None:
    """`measured` for a point without datasets (its delegates' metrics are point-level)."""
    _emit(EVENT_MEASURED, resource=point_resource(run, step), payload={"metrics": metrics})


def _regressions(
    run: str, step: int, per_dataset: dict[str, dict[str, float]], rule: RegressionRule | None, jsonl_path: str | None
) -> list[Regression]:
    if rule is None:
        return []
    if not jsonl_path:
        get_run_logger().warning("regression rule set but no JSONL sink: no history to compare %s/step-%d", run, step)
        return []
    history: dict[str, list[tuple[int, dict[str, float]]]] = {}
    for row in Ledger(jsonl_path).read(run):
        if row.state == "measured" and row.dataset is not None and row.step != step:
            history.setdefault(row.dataset, []).append((row.step, row.metrics))
    found = []
    for ds, metrics in per_dataset.items():
        regression = rule.check(ds, step, metrics, history.get(ds, []))
        if regression is not None:
            found.append(regression)
            _emit(EVENT_REGRESSED, resource=point_resource(run, step, ds), payload=regression.model_dump())
            get_run_logger().warning(
                "%s/step-%d %s regressed: %s %.4f, %s %.4f at step %d",
                run,
                step,
                ds,
                regression.metric,
                regression.value,
                rule.baseline,
                regression.baseline,
                regression.baseline_step,
            )
    return found


def emit_skipped(run: str, step: int, reason: str, message: str) -> None:
    _emit(EVENT_SKIPPED, resource=point_resource(run, step), payload={"reason": reason, "message": message[:1000]})


def emit_failed(run: str, step: int, error: str, flow_run_id: str | None = None) -> None:
    """`failed` for the point; `flow_run_id`: the point's flow run, when emitted outside it."""
    related = [{"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}]
    _emit(
        EVENT_FAILED,
        resource=point_resource(run, step),
        related=related if flow_run_id else None,
        payload={"reason": "crashed", "error": error[:1000]},
    )
