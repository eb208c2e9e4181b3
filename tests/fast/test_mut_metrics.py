"""pass@k and the eval metrics (pinned_eval/scoring/passk.py, metrics.py): exact values and errors
that `make mutants` found unchecked (docs/testing.md)."""

from __future__ import annotations

import pytest

from pinned_eval.scoring.metrics import ScoredSample, dataset_metrics, point_metrics
from pinned_eval.scoring.passk import mean_pass_at_k, pass_at_k_values


def test_the_errors_name_the_bad_argument() -> None:
    with pytest.raises(ValueError, match=r"^n must be >= 1, got 0$"):
        pass_at_k_values(0)
    with pytest.raises(ValueError, match=r"^mean_pass_at_k needs at least one prompt$"):
        mean_pass_at_k([], 4, 1)


def _s(j: int, version: str | None, reward: float | None = 1.0) -> ScoredSample:
    return ScoredSample(0, j, "r", 1, reward, False, version)


def test_fractional_versions_are_numeric() -> None:
    m = dataset_metrics("ds", [_s(0, "1.5"), _s(1, "2.5"), _s(2, "2.5")])
    assert m["eval/ds/weight_version/mean"] == pytest.approx(13 / 6)
    assert (m["eval/ds/weight_version/min"], m["eval/ds/weight_version/max"]) == (1.5, 2.5)
    assert m["eval/ds/weight_version/mixed_version_ratio"] == pytest.approx(1 / 3)


def test_a_non_numeric_version_beside_numeric_ones_is_mixed_but_not_averaged() -> None:
    m = dataset_metrics("ds", [_s(0, "4"), _s(1, "4"), _s(2, "base")])
    assert m["eval/ds/weight_version/mean"] == 4.0
    assert m["eval/ds/weight_version/mixed_version_ratio"] == pytest.approx(1 / 3)


def test_zero_lag_duration_and_export_time_are_valid() -> None:
    assert point_metrics(0, 0, 0.0, export_time_seconds=0.0) == {
        "eval/step": 0,
        "eval/lag_steps": 0,
        "eval/duration_seconds": 0.0,
        "eval/export_time_seconds": 0.0,
    }


@pytest.mark.parametrize(("lag", "duration", "export"), [(-1, 1.0, None), (0, -0.5, None), (0, 1.0, -2.0)])
def test_a_negative_point_metric_is_refused_with_all_three_values(
    lag: int, duration: float, export: float | None
) -> None:
    with pytest.raises(ValueError) as err:
        point_metrics(5, lag, duration, export_time_seconds=export)
    assert str(err.value) == (
        f"point metrics must be non-negative: lag_steps={lag}, "
        f"duration_seconds={duration}, export_time_seconds={export}"
    )


def test_pass_at_k_errors_are_exact() -> None:
    with pytest.raises(ValueError) as err:
        dataset_metrics("ds", [_s(0, "1"), ScoredSample(1, 0, "r", 1, 1.0, False, "1"), _s(1, "1")], pass_at_k=True)
    assert str(err.value) == "eval/ds: pass@k needs the same number of samples per prompt, got sizes [1, 2]"
    with pytest.raises(ValueError) as err:
        dataset_metrics("ds", [_s(3, "1"), _s(3, "1")])
    assert str(err.value) == "duplicate sample: prompt_index=0, sample_index=3"


def test_a_reward_at_the_threshold_passes_and_none_never_does() -> None:
    samples = [ScoredSample(0, 0, "r", 1, 0.5, False, "1"), ScoredSample(0, 1, "r", 1, None, False, "1")]
    m = dataset_metrics("ds", samples, pass_at_k=True, pass_threshold=0.5)
    assert (m["eval/ds-pass@1"], m["eval/ds-pass@2"]) == (0.5, 1.0)
    none_only = [ScoredSample(0, j, "r", 1, None, False, "1") for j in range(2)]
    assert dataset_metrics("ds", none_only, pass_at_k=True, pass_threshold=0.0)["eval/ds-pass@2"] == 0.0


def test_score_keeps_every_field_of_the_response() -> None:
    sample = ScoredSample.score(
        lambda response, label: 0.25,
        prompt_index=3,
        sample_index=1,
        response="forty-two",
        label="42",
        response_len=9,
        finish_reason="stop",
        weight_version="17",
    )
    assert sample == ScoredSample(3, 1, "forty-two", 9, 0.25, False, "17")
