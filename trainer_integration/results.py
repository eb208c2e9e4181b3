"""Typed results of the trainer side: what `dispatch` did, and how a point ended.

A point's outcome is read from its newest flow run: Completed → measured; Completed named
"Skipped" → skipped, reason = the message up to its first `:`; Failed/Crashed → reason
`crashed`; Cancelled; anything not terminal (or no run yet) → pending. Metrics per dataset come
from the JSONL sink for measured points. `best_of` picks the measured point with the best value
of a metric (ties: the earliest step).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.points import outcome_of as state_outcome
from pinned_eval.points import reason_of
from trainer_integration.rest import PointRun

# "exporting": a two-phase export is staged and being written; its request follows the marker
Action = Literal[
    "requested", "exporting", "exists", "not_due", "skipped_busy", "skipped_export_busy",
    "skipped_export_failed", "skipped_spool_failed",
]
OutcomeState = Literal["measured", "skipped", "failed", "crashed", "cancelled", "pending"]


class DispatchResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    step: int
    action: Action
    in_flight: int = Field(description="Points in flight seen by admission (this one excluded).")
    waited_seconds: float = 0.0
    export_time_seconds: float | None = Field(
        default=None, description="The export's time in the call: all of it, or a two-phase export's staging copy."
    )
    stall_seconds: float = Field(description="Wall time the call took, export included.")
    admitted_offline: bool = Field(default=False, description="API unreachable: admitted unchecked.")
    reason: str | None = Field(default=None, description="Why a skipped point was skipped, where not in a record.")


class PointOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    step: int
    state: OutcomeState
    reason: str | None = None
    message: str | None = None
    flow_run_id: str | None = None
    flow_runs: int = Field(default=0, description="Flow runs seen for this step (1 expected).")
    metrics: dict[str, dict[str, float]] = Field(default_factory=dict, description="dataset -> metrics")
    point_metrics: dict[str, float] = Field(
        default_factory=dict,
        description="A measured point's point-level row (no dataset): a point that ran only delegates.",
    )


def point_outcome(step: int, runs: list[PointRun], rows: dict[str | None, dict[str, float]]) -> PointOutcome:
    if not runs:
        return PointOutcome(step=step, state="pending")
    run = runs[-1]
    kind = state_outcome(run.state_type, run.state_name) if run.terminal else "pending"
    state: OutcomeState = "pending" if kind in ("running", "scheduled") else kind  # type: ignore[assignment]
    reason = reason_of(kind, run.message)
    measured = state == "measured"
    metrics = {k: v for k, v in rows.items() if k is not None} if measured else {}
    point_metrics = rows.get(None, {}) if measured else {}
    return PointOutcome(
        step=step,
        state=state,
        reason=reason,
        message=run.message,
        flow_run_id=run.id,
        flow_runs=len(runs),
        metrics=metrics,
        point_metrics=point_metrics,
    )


def metric_value(outcome: PointOutcome, metric: str) -> float | None:
    """`metric` of a measured point (from whichever dataset's row holds it, else its point-level
    row: a delegate's metric where no dataset ran), else None."""
    if outcome.state != "measured":
        return None
    return next((m[metric] for m in (*outcome.metrics.values(), outcome.point_metrics) if metric in m), None)


def best_of(
    outcomes: Iterable[PointOutcome], metric: str, *, mode: Literal["max", "min"] = "max"
) -> PointOutcome | None:
    """The measured outcome with the best `metric` (ties: the earliest step); None when none has it."""
    scored = [(v, o) for o in outcomes if (v := metric_value(o, metric)) is not None]
    if not scored:
        return None
    sign = 1.0 if mode == "max" else -1.0
    return max(scored, key=lambda vo: (sign * vo[0], -vo[1].step))[1]
