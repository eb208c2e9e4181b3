"""`best_of`: the measured point with the best metric (EvalClient.best's rule)."""

from __future__ import annotations

from trainer_integration.results import PointOutcome, best_of


def _o(step: int, value: float | None, state: str = "measured") -> PointOutcome:
    metrics = {"add": {"eval/add": value, "eval/add-pass@2": 1 - value}} if value is not None else {}
    return PointOutcome(step=step, state=state, metrics=metrics)  # type: ignore[arg-type]


def test_best_max_min_ties_and_states() -> None:
    outcomes = [_o(100, 0.4), _o(200, 0.7), _o(300, 0.7), _o(400, None, "skipped"), _o(500, 0.2)]
    assert best_of(outcomes, "eval/add").step == 200  # type: ignore[union-attr]  # tie with 300: earliest
    assert best_of(outcomes, "eval/add", mode="min").step == 500  # type: ignore[union-attr]
    assert best_of(outcomes, "eval/add-pass@2").step == 500  # type: ignore[union-attr]
    assert best_of(outcomes, "eval/other") is None
    pending = PointOutcome(step=600, state="pending", metrics={"add": {"eval/add": 1.0}})
    assert best_of([*outcomes, pending], "eval/add").step == 200  # type: ignore[union-attr]  # not measured


def test_a_point_that_ran_only_delegates_keeps_its_point_level_metrics() -> None:
    """A measured point with no dataset due but a delegate (one ledger row, dataset None): its
    delegate metrics are the outcome's `point_metrics`, found by `metric_value` and `best_of`;
    a skipped point's point-level row (its skip metrics) is not."""
    from trainer_integration.rest import PointRun
    from trainer_integration.results import metric_value, point_outcome

    def run(state_type: str, state_name: str, message: str) -> PointRun:
        return PointRun(id="fr", name="x/step-6", step=6, state_type=state_type, state_name=state_name,
                        message=message, created="2026-12-05T00:00:00Z")

    measured = point_outcome(6, [run("COMPLETED", "Completed", "measured x/step-6")],
                             {None: {"eval/step": 6.0, "eval/gpqa": 0.25, "eval/datasets_run": 0.0}})
    assert (measured.state, measured.metrics) == ("measured", {})
    assert measured.point_metrics == {"eval/step": 6.0, "eval/gpqa": 0.25, "eval/datasets_run": 0.0}
    assert metric_value(measured, "eval/gpqa") == 0.25
    assert best_of([_o(4, 0.1), measured], "eval/gpqa") is measured
    skipped = point_outcome(8, [run("COMPLETED", "Skipped", "quota: over budget")], {None: {"eval/skipped_quota": 1.0}})
    assert (skipped.state, skipped.point_metrics, metric_value(skipped, "eval/skipped_quota")) == ("skipped", {}, None)
