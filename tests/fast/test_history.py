"""History assembly from hand-built flow-run records and metric rows (no server)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from app.history import FlowRunRecord, build_history
from pinned_eval.points import outcome_of, reason_of
from pinned_eval.sinks import MetricRow

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def record(step: int, kind: str, name: str, message: str | None = None, *, rid: str | None = None,
           created: float = 0.0, states: list[tuple[str, str, str | None, float]] | None = None) -> FlowRunRecord:
    return FlowRunRecord(
        id=rid or f"id-{step}-{created}", name=f"exp/step-{step}", run="exp", step=step,
        parameters={"run": "exp", "step": step}, state_type=kind, state_name=name, message=message,
        created=at(created), states=[(k, n, m, at(t)) for k, n, m, t in (states or [])],
    )


def measured(step: int, **scores: float) -> list[MetricRow]:
    return [
        MetricRow(run="exp", step=step, dataset=ds, state="measured", weight_version=str(step),
                  metrics={f"eval/{ds}": v, "eval/step": step, "eval/lag_steps": 2.0})
        for ds, v in scores.items()
    ]


def test_outcomes_and_reasons():
    assert outcome_of("COMPLETED", "Skipped") == "skipped"
    assert outcome_of("COMPLETED", "Completed") == "measured"
    assert outcome_of("CRASHED", "Crashed") == "crashed"
    assert outcome_of("SCHEDULED", "AwaitingRetry") == "scheduled"
    assert reason_of("skipped", "pin_violation: engine 2 reports 6") == "pin_violation"
    assert reason_of("failed", "Flow run encountered an exception") == "crashed"
    assert reason_of("measured", "measured exp/step-1") is None


def test_retried_in_place_keeps_both_attempts_and_the_final_state_wins():
    states = [
        ("SCHEDULED", "Scheduled", None, 0), ("PENDING", "Pending", None, 1), ("RUNNING", "Running", None, 2),
        ("FAILED", "Failed", "Flow run encountered an exception: RuntimeError: boom", 5),
        ("SCHEDULED", "AwaitingRetry", "Retried via pinned-eval rerun", 6), ("PENDING", "Pending", None, 7),
        ("RUNNING", "Running", None, 8), ("COMPLETED", "Completed", "measured exp/step-4", 12),
    ]
    rows = measured(4, add=0.5, sub=0.25)
    h = build_history("exp", [record(4, "COMPLETED", "Completed", "measured", rid="r4", states=states)], rows)
    [p] = h.points
    assert (p.outcome, p.reason, p.weight_version, p.lag_steps) == ("measured", None, "4", 2.0)
    assert p.scores == {"add": 0.5, "sub": 0.25}
    assert [(a.number, a.outcome, a.started, a.ended) for a in p.attempts] == [
        (1, "failed", at(2), at(5)), (2, "measured", at(8), at(12))
    ]
    assert {a.flow_run_id for a in p.attempts} == {"r4"}


def test_latest_run_of_a_step_wins_and_older_runs_stay_attempts():
    old = record(3, "COMPLETED", "Skipped", "busy: 2 points in flight", rid="old", created=0,
                 states=[("RUNNING", "Running", None, 1), ("COMPLETED", "Skipped", "busy: 2 in flight", 2)])
    new = record(3, "RUNNING", "Running", rid="new", created=10, states=[("RUNNING", "Running", None, 11)])
    rows = [MetricRow(run="exp", step=3, state="skipped", reason="busy", metrics={"eval/skipped_busy": 1})]
    [p] = build_history("exp", [new, old], rows).points
    assert p.outcome == "running" and p.flow_run_id == "new" and p.scores == {}
    assert [(a.flow_run_id, a.outcome, a.ended) for a in p.attempts] == [
        ("old", "skipped", at(2)), ("new", "running", None)
    ]


def test_skip_reason_comes_from_the_row_and_rows_without_runs_are_points():
    skipped = record(2, "COMPLETED", "Skipped", "ckpt_missing: /s/step_2: no marker")
    crashed = record(5, "CRASHED", "Crashed", "Process exited with status code: -9")
    rows = [
        *measured(1, add=0.75),
        MetricRow(run="exp", step=2, state="skipped", reason="ckpt_missing", metrics={"eval/skipped_ckpt_missing": 1}),
        MetricRow(run="exp", step=5, state="failed", reason="crashed", metrics={"eval/skipped_crashed": 1}),
        MetricRow(run="other", step=9, state="skipped", reason="busy"),
    ]
    h = build_history("exp", [skipped, crashed], rows)
    assert [(p.step, p.outcome, p.reason) for p in h.points] == [
        (1, "measured", None), (2, "skipped", "ckpt_missing"), (5, "crashed", "crashed")
    ]
    assert h.datasets == ["add"] and h.point(1).attempts == [] and h.point(9) is None


def test_scores_only_from_a_measured_latest_run():
    # a rerun in flight after a measured point: its old rows are not this run's result
    rec = record(6, "SCHEDULED", "AwaitingRetry", rid="x")
    [p] = build_history("exp", [rec], measured(6, add=1.0)).points
    assert p.outcome == "scheduled" and p.scores == {} and p.weight_version is None
