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
