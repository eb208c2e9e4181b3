"""Typed results of the trainer side: what `dispatch` did, and how a point ended.

A point's outcome is read from its newest flow run: Completed → measured; Completed named
"Skipped" → skipped, reason = the message up to its first `:`; Failed/Crashed → reason
`crashed`; Cancelled; anything not terminal (or no run yet) → pending. Metrics per dataset come
from the JSONL sink for measured points.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trainer_integration.rest import PointRun

Action = Literal["requested", "exists", "not_due", "skipped_busy", "skipped_export_failed"]
OutcomeState = Literal["measured", "skipped", "failed", "crashed", "cancelled", "pending"]


class DispatchResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    step: int
    action: Action
    in_flight: int = Field(description="Points in flight seen by admission (this one excluded).")
    waited_seconds: float = 0.0
    export_time_seconds: float | None = None
    stall_seconds: float = Field(description="Wall time the call took, export included.")
    admitted_offline: bool = Field(default=False, description="API unreachable: admitted unchecked.")


class PointOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    step: int
    state: OutcomeState
    reason: str | None = None
    message: str | None = None
    flow_run_id: str | None = None
    flow_runs: int = Field(default=0, description="Flow runs seen for this step (1 expected).")
    metrics: dict[str, dict[str, float]] = Field(default_factory=dict, description="dataset -> metrics")


def outcome_of(step: int, runs: list[PointRun], rows: dict[str | None, dict[str, float]]) -> PointOutcome:
    if not runs:
        return PointOutcome(step=step, state="pending")
    run = runs[-1]
    reason: str | None = None
    state: OutcomeState
    if not run.terminal:
        state = "pending"
    elif run.state_type == "COMPLETED" and run.state_name == "Skipped":
        state, reason = "skipped", (run.message or "").split(":", 1)[0] or None
    elif run.state_type == "COMPLETED":
        state = "measured"
    elif run.state_type == "CANCELLED":
        state = "cancelled"
    else:
        state, reason = ("crashed" if run.state_type == "CRASHED" else "failed"), "crashed"
    metrics = {k: v for k, v in rows.items() if k is not None} if state == "measured" else {}
    return PointOutcome(
        step=step,
        state=state,
        reason=reason,
        message=run.message,
        flow_run_id=run.id,
        flow_runs=len(runs),
        metrics=metrics,
    )
