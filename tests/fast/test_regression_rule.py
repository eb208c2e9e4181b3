"""The suite block's regression rule (docs/alerts.md): best or previous, threshold, interval."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from blocks import EvalSuiteBlock
from pinned_eval.scoring.regression import Regression, RegressionRule
from pinned_eval.suite import default_suite

HISTORY = [(10, {"eval/ds": 0.50}), (20, {"eval/ds": 0.80}), (30, {"eval/ds": 0.60}), (50, {"eval/ds": 0.99})]


def _now(value: float, high: float | None = None) -> dict[str, float]:
    return {"eval/ds": value, **({"eval/ds/ci95_high": high} if high is not None else {})}


def test_best_is_the_highest_earlier_value() -> None:
    found = RegressionRule().check("ds", 40, _now(0.55, high=0.70), HISTORY)
    # step 50 is later than 40: ignored
    assert found == Regression(dataset="ds", metric="eval/ds", value=0.55, baseline=0.80, baseline_step=20,
                               drop=0.80 - 0.55, ci95_high=0.70)


def test_previous_is_the_nearest_earlier_step() -> None:
    rule = RegressionRule(baseline="previous")
    found = rule.check("ds", 40, _now(0.55, high=0.58), HISTORY)
    assert found is not None and (found.baseline, found.baseline_step) == (0.60, 30)
    assert rule.check("ds", 40, _now(0.61, high=0.70), HISTORY) is None  # no drop


def test_threshold_and_interval_gate_the_drop() -> None:
    assert RegressionRule(threshold=0.3).check("ds", 40, _now(0.55, high=0.6), HISTORY) is None  # drop 0.25
    assert RegressionRule().check("ds", 40, _now(0.55, high=0.80), HISTORY) is None  # best inside the interval
    assert RegressionRule(outside_interval=False).check("ds", 40, _now(0.55, high=0.80), HISTORY) is not None


def test_no_baseline_no_regression_and_other_metrics() -> None:
    assert RegressionRule().check("ds", 5, _now(0.0, high=0.0), HISTORY) is None  # nothing earlier
    assert RegressionRule().check("other", 40, _now(0.0), HISTORY) is None  # metric absent
    rule = RegressionRule(metric="eval/{ds}-pass@4")
    found = rule.check("ds", 3, {"eval/ds-pass@4": 0.2, "eval/ds/ci95_high": 0.9}, [(1, {"eval/ds-pass@4": 0.5})])
    assert found is not None and found.ci95_high is None  # the interval is the mean's: not used for pass@4


def test_rule_lives_in_the_suite_block_and_names_bad_fields() -> None:
    block = EvalSuiteBlock(suite=default_suite(), regression={"baseline": "previous", "threshold": 0.1})
    assert block.regression == RegressionRule(baseline="previous", threshold=0.1)
    assert EvalSuiteBlock(suite=default_suite()).regression is None
    with pytest.raises(ValidationError, match=r"regression\.threshold"):
        EvalSuiteBlock(suite=default_suite(), regression={"threshold": -1})
    with pytest.raises(ValidationError, match=r"regression\.metric"):
        EvalSuiteBlock(suite=default_suite(), regression={"metric": "eval/arith_add"})
