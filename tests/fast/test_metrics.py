"""Eval metrics: exact miles key names, None rewards, pass@k, response length, weight versions."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pinned_eval.scoring.metrics import ScoredSample, dataset_metrics, point_metrics, skip_metrics
from pinned_eval.scoring.rewards import exact_match
from pinned_eval.skips import SkipReason

DESIGN_KEY = re.compile(
    r"^eval/ds(|-truncated_ratio|-none_reward_ratio|-pass@\d+|/response_len/(mean|max|min)"
    r"|/weight_version/(mean|min|max|mixed_version_ratio)|/stderr|/ci95_(low|high)|/avg@\d+|-pass\^\d+|-maj@\d+)$"
)


def _sample(
    p: int,
    j: int,
    reward: float | None,
    *,
    length: int = 3,
    truncated: bool = False,
    version: str | None = "12",
) -> ScoredSample:
    return ScoredSample(p, j, "r", length, reward, truncated, version)


def _grid(rewards: list[list[float | None]], version: str | None = "12") -> list[ScoredSample]:
    return [
        _sample(p, j, r, length=p + j + 1, version=version)
        for p, row in enumerate(rewards)
        for j, r in enumerate(row)
    ]


def test_full_point_has_exactly_the_design_keys() -> None:
    samples = [
        _sample(0, 0, 1.0, length=2),
        _sample(0, 1, None, length=4, truncated=True),
        _sample(1, 0, 0.0, length=6),
        _sample(1, 1, 1.0, length=8, truncated=True),
    ]
    m = dataset_metrics("ds", samples, pass_at_k=True)
    assert all(DESIGN_KEY.match(k) for k in m), sorted(m)
    assert m == {
        "eval/ds": 0.5,
        "eval/ds-none_reward_ratio": 0.25,
        "eval/ds-truncated_ratio": 0.5,
        "eval/ds-pass@1": 0.5,
        "eval/ds-pass@2": 1.0,
        "eval/ds/avg@2": 0.5,
        "eval/ds-pass^1": 0.5,
        "eval/ds-pass^2": 0.0,
        "eval/ds-maj@1": 0.5,
        "eval/ds-maj@2": 0.5,
        "eval/ds/stderr": 0.0,
        "eval/ds/ci95_low": 0.5,
        "eval/ds/ci95_high": 0.5,
        "eval/ds/response_len/mean": 5.0,
        "eval/ds/response_len/max": 8.0,
        "eval/ds/response_len/min": 2.0,
        "eval/ds/weight_version/mean": 12.0,
        "eval/ds/weight_version/min": 12.0,
        "eval/ds/weight_version/max": 12.0,
        "eval/ds/weight_version/mixed_version_ratio": 0.0,
    }


def test_none_rewards_count_as_zero() -> None:
    m = dataset_metrics("ds", _grid([[None, None, 0.5, 1.0]]))
    assert m["eval/ds"] == pytest.approx(1.5 / 4)
    assert m["eval/ds-none_reward_ratio"] == 0.5


def test_empty_dataset_logs_zeros_only() -> None:
    assert dataset_metrics("ds", [], pass_at_k=True) == {
        "eval/ds": 0.0,
        "eval/ds-none_reward_ratio": 0.0,
        "eval/ds-truncated_ratio": 0.0,
    }


def test_pass_at_k_only_when_enabled_and_n_above_one() -> None:
    assert not any("pass@" in k for k in dataset_metrics("ds", _grid([[1.0, 0.0]])))
    assert not any("pass@" in k for k in dataset_metrics("ds", _grid([[1.0], [0.0]]), pass_at_k=True))
    ks = [k for k in dataset_metrics("ds", _grid([[0.0] * 6]), pass_at_k=True) if "pass@" in k]
    assert ks == ["eval/ds-pass@1", "eval/ds-pass@2", "eval/ds-pass@4"]


def _brute_pass_at_k(rows: list[list[bool]], k: int) -> float:
    per_prompt = []
    for row in rows:
        subsets = list(itertools.combinations(row, k))
        per_prompt.append(sum(any(s) for s in subsets) / len(subsets))
    return sum(per_prompt) / len(per_prompt)


@given(
    st.integers(2, 7).flatmap(
        lambda n: st.lists(
            st.lists(st.sampled_from([0.0, 1.0, None, 0.5]), min_size=n, max_size=n), min_size=1, max_size=5
        )
    )
)
def test_pass_at_k_matches_brute_force(rewards: list[list[float | None]]) -> None:
    m = dataset_metrics("ds", _grid(rewards), pass_at_k=True)
    success = [[r == 1.0 for r in row] for row in rewards]
    k = 1
    while k <= len(rewards[0]):
        assert m[f"eval/ds-pass@{k}"] == pytest.approx(_brute_pass_at_k(success, k))
        k *= 2
    assert f"eval/ds-pass@{k}" not in m


def test_pass_threshold() -> None:
    rewards = [[0.9, 0.2]]
    assert dataset_metrics("ds", _grid(rewards), pass_at_k=True)["eval/ds-pass@2"] == 0.0
    assert dataset_metrics("ds", _grid(rewards), pass_at_k=True, pass_threshold=0.5)["eval/ds-pass@2"] == 1.0


def test_unequal_groups_and_duplicates_rejected() -> None:
    with pytest.raises(
        ValueError, match=r"eval/ds: pass@k needs the same number of samples per prompt.*\[1, 2\]"
    ):
        dataset_metrics("ds", [_sample(0, 0, 1.0), _sample(0, 1, 1.0), _sample(1, 0, 1.0)], pass_at_k=True)
    with pytest.raises(ValueError, match="duplicate sample: prompt_index=0, sample_index=1"):
        dataset_metrics("ds", [_sample(0, 1, 1.0), _sample(0, 1, 0.0)])


def test_weight_versions_prove_the_pin() -> None:
    pinned = dataset_metrics("ds", _grid([[1.0, 1.0]], version="40"), expected_version="40")
    assert pinned["eval/ds/weight_version/mean"] == 40.0
    assert pinned["eval/ds/weight_version/mixed_version_ratio"] == 0.0


def test_mixed_versions_against_expected_and_majority() -> None:
    samples = [_sample(0, j, 1.0, version=v) for j, v in enumerate(["7", "7", "7", "9"])]
    m = dataset_metrics("ds", samples)
    assert (m["eval/ds/weight_version/min"], m["eval/ds/weight_version/max"]) == (7.0, 9.0)
    assert m["eval/ds/weight_version/mean"] == 7.5
    assert m["eval/ds/weight_version/mixed_version_ratio"] == 0.25  # majority "7"
    assert (
        dataset_metrics("ds", samples, expected_version="9")["eval/ds/weight_version/mixed_version_ratio"]
        == 0.75
    )
    # mean can equal the step while versions are mixed: the ratio is what catches it
    spread = [_sample(0, j, 1.0, version=v) for j, v in enumerate(["8", "10"])]
    m = dataset_metrics("ds", spread, expected_version="9")
    assert m["eval/ds/weight_version/mean"] == 9.0
    assert m["eval/ds/weight_version/mixed_version_ratio"] == 1.0


def test_missing_and_non_numeric_versions() -> None:
    assert not any("weight_version" in k for k in dataset_metrics("ds", _grid([[1.0]], version="base")))
    assert not any("weight_version" in k for k in dataset_metrics("ds", _grid([[1.0]], version=None)))
    m = dataset_metrics("ds", [_sample(0, 0, 1.0, version="3"), _sample(0, 1, 1.0, version=None)])
    assert m["eval/ds/weight_version/mean"] == 3.0
    assert m["eval/ds/weight_version/mixed_version_ratio"] == 0.5


def test_scored_sample_score_applies_reward_and_truncation() -> None:
    s = ScoredSample.score(
        exact_match,
        prompt_index=2,
        sample_index=1,
        response="7\n",
        label="7",
        response_len=2,
        finish_reason="length",
        weight_version="5",
    )
    assert (s.reward, s.truncated, s.prompt_index, s.sample_index) == (1.0, True, 2, 1)
    stopped = ScoredSample.score(
        exact_match, prompt_index=0, sample_index=0, response="8", label="7", response_len=1,
        finish_reason="stop", weight_version="5",
    )
    assert (stopped.reward, stopped.truncated) == (0.0, False)


def test_scored_sample_score_propagates_reward_errors() -> None:
    def broken(response: str, label: str) -> float:
        raise ZeroDivisionError("grader bug")

    with pytest.raises(ZeroDivisionError, match="grader bug"):
        ScoredSample.score(
            broken, prompt_index=0, sample_index=0, response="x", label="y", response_len=1,
            finish_reason=None, weight_version=None,
        )


def test_point_metrics() -> None:
    assert point_metrics(12, 3, 41.5) == {"eval/step": 12, "eval/lag_steps": 3, "eval/duration_seconds": 41.5}
    assert point_metrics(12, 0, 1.0, export_time_seconds=2.5)["eval/export_time_seconds"] == 2.5
    with pytest.raises(ValueError, match="lag_steps=-1"):
        point_metrics(12, -1, 1.0)
    with pytest.raises(ValueError, match="export_time_seconds=-2"):
        point_metrics(12, 0, 1.0, export_time_seconds=-2)


def test_skip_metrics() -> None:
    assert skip_metrics(8, SkipReason.BUSY) == {"eval/step": 8, "eval/skipped_busy": 1}
    assert skip_metrics(9, "quota") == {"eval/step": 9, "eval/skipped_quota": 1}
    with pytest.raises(ValueError, match="lowercase slug"):
        skip_metrics(9, "Bad Reason")
