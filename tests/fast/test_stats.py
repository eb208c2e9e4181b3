"""Statistics per dataset (docs/metrics.md) against brute force: every k-subset, every resample."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from pinned_eval.scoring.metrics import ScoredSample, dataset_metrics
from pinned_eval.scoring.stats import bootstrap_ci, majority_at_k, pass_hat_k, stderr, vote_key


def _all_correct_fraction(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) that are all correct."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(all(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_hat_k_matches_every_k_subset(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_hat_k(n, c, k) == pytest.approx(_all_correct_fraction(n, c, k), abs=1e-12), (n, c, k)


def test_pass_hat_k_exact_values() -> None:
    assert pass_hat_k(4, 2, 2) == 1 / 6
    assert pass_hat_k(4, 4, 4) == 1.0
    assert pass_hat_k(4, 3, 4) == 0.0
    with pytest.raises(ValueError, match="k=5"):
        pass_hat_k(4, 1, 5)


def _exact_bootstrap(means: list[float]) -> tuple[float, float]:
    """The 2.5% / 97.5% inverted-CDF quantiles of the mean over all P^P equally likely resamples."""
    p = len(means)
    dist = Counter(round(sum(means[i] for i in idx) / p, 12) for idx in itertools.product(range(p), repeat=p))
    total, acc, out = p**p, 0, {}
    for value in sorted(dist):
        acc += dist[value]
        for q in (0.025, 0.975):
            if q not in out and acc / total >= q:
                out[q] = value
    return out[0.025], out[0.975]


@pytest.mark.parametrize(
    "means", [[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.5, 1.0, 0.0, 0.25, 1.0]]
)
def test_bootstrap_interval_is_the_exact_bootstrap_one(means: list[float]) -> None:
    """The seeded Monte Carlo interval lands on the bounds of the enumerated bootstrap distribution."""
    low, high = bootstrap_ci(means)
    assert (round(low, 12), round(high, 12)) == _exact_bootstrap(means)


def test_bootstrap_exact_values_are_seeded_and_deterministic() -> None:
    means = [1.0, 1.0, 1.0, 0.0, 0.0]
    assert _exact_bootstrap(means) == (0.2, 1.0)
    assert bootstrap_ci(means) == bootstrap_ci(list(means)) == (0.2, 1.0)
    assert bootstrap_ci([0.75] * 4) == (0.75, 0.75)
    assert bootstrap_ci(means, seed=1) == bootstrap_ci(means, seed=1)


def test_stderr_is_sample_std_over_sqrt_p() -> None:
    assert stderr([1.0, 0.0]) == 0.5  # std(ddof=1) = sqrt(0.5); / sqrt(2)
    assert stderr([1.0, 1.0, 0.0, 0.0]) == pytest.approx(math.sqrt(1 / 3) / 2, abs=1e-15)
    with pytest.raises(ValueError, match="at least 2 prompts"):
        stderr([1.0])


def test_vote_key_and_majority() -> None:
    assert vote_key("so \\boxed{ 42 } done") == "42"
    assert vote_key("  7\n") == "7"
    answers, correct = ["3", "4", "4", "3", "3"], [True, False, False, True, True]
    assert majority_at_k(answers, correct, 1) == 1.0
    assert majority_at_k(answers, correct, 2) == 1.0  # tie 1-1: the first seen ("3") wins
    assert majority_at_k(answers, correct, 3) == 0.0  # "4" twice
    assert majority_at_k(answers, correct, 5) == 1.0  # "3" three times


def _samples(rows: list[list[tuple[str, float | None]]]) -> list[ScoredSample]:
    return [
        ScoredSample(p, j, text, 1, reward, False, "5")
        for p, row in enumerate(rows)
        for j, (text, reward) in enumerate(row)
    ]


def test_dataset_metrics_statistics_against_brute_force() -> None:
    rows = [
        [("1", 1.0), ("2", 0.0), ("1", 1.0), ("1", 1.0)],
        [("5", 0.0), ("6", 1.0), ("6", 1.0), ("5", 0.0)],
        [("9", None), ("9", None), ("8", 0.0), ("8", 0.0)],
    ]
    m = dataset_metrics("ds", _samples(rows), pass_at_k=True)
    means = [0.75, 0.5, 0.0]
    assert m["eval/ds/avg@4"] == 1.25 / 3
    assert m["eval/ds/stderr"] == pytest.approx(float(np.std(means, ddof=1)) / math.sqrt(3), abs=1e-15)
    assert (m["eval/ds/ci95_low"], m["eval/ds/ci95_high"]) == _exact_bootstrap(means) == (0.0, 0.75)
    for k in (1, 2, 4):
        brute = [
            sum(all(r[i][1] == 1.0 for i in s) for s in itertools.combinations(range(4), k)) / math.comb(4, k)
            for r in rows
        ]
        assert m[f"eval/ds-pass^{k}"] == pytest.approx(sum(brute) / 3, abs=1e-12)
    assert m["eval/ds-maj@1"] == 1 / 3  # first answers: 1 (right), 5 (wrong), 9 (None: wrong)
    assert m["eval/ds-maj@2"] == 1 / 3  # ties go to the first answer
    assert m["eval/ds-maj@4"] == 1 / 3  # "1" x3; "5"/"6" tie 2-2 → "5" (wrong); "9"/"8" tie → "9"


def test_statistics_off_and_single_prompt() -> None:
    m = dataset_metrics("ds", _samples([[("1", 1.0), ("2", 0.0)]]), statistics=False)
    assert not any(k.endswith(("stderr", "ci95_low", "ci95_high")) for k in m)
    one = dataset_metrics("ds", _samples([[("1", 1.0), ("2", 0.0)]]))
    assert "eval/ds/stderr" not in one  # one prompt: no spread to measure
    assert (one["eval/ds/ci95_low"], one["eval/ds/ci95_high"]) == (0.5, 0.5)
    assert not any("avg@" in k or "maj@" in k or "pass^" in k for k in one)  # pass@k off


def test_bootstrap_bounds_are_means_a_resample_reached() -> None:
    """Inverted-CDF quantiles, not interpolated ones: with few resamples the bounds stay on the grid."""
    reachable = {0.0, 0.5, 1.0}  # the mean of two prompts drawn with replacement from [0, 1]
    bounds = {b for seed in range(20) for b in bootstrap_ci([0.0, 1.0], resamples=5, seed=seed)}
    assert bounds <= reachable and {0.0, 1.0} <= bounds
