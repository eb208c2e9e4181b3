"""Unbiased pass@k against a brute-force count over all k-subsets."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pinned_eval.scoring.passk import mean_pass_at_k, pass_at_k, pass_at_k_values


def _brute_force(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) that contain a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_brute_force_for_every_c_and_k(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_force(n, c, k), abs=1e-12), (n, c, k)


@given(st.integers(1, 400).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_matches_binomial_formula_for_large_n(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-9)
    assert 0.0 <= pass_at_k(n, c, k) <= 1.0


def test_known_values() -> None:
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)


def test_stable_for_huge_n() -> None:
    # C(10000, 5000) overflows floats; the product form does not.
    assert pass_at_k(10_000, 1, 5_000) == pytest.approx(0.5)
    assert pass_at_k(10_000, 0, 5_000) == 0.0


def test_monotone_in_k_and_c() -> None:
    n = 16
    for c in range(n + 1):
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert values == sorted(values)
    for k in (1, 4, 16):
        values = [pass_at_k(n, c, k) for c in range(n + 1)]
        assert values == sorted(values)


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_invalid_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


@pytest.mark.parametrize(
    ("n", "ks"),
    [(1, [1]), (2, [1, 2]), (3, [1, 2]), (4, [1, 2, 4]), (16, [1, 2, 4, 8, 16]), (17, [1, 2, 4, 8, 16])],
)
def test_pass_at_k_values(n: int, ks: list[int]) -> None:
    assert pass_at_k_values(n) == ks


def test_pass_at_k_values_rejects_zero() -> None:
    with pytest.raises(ValueError):
        pass_at_k_values(0)


def test_mean_over_prompts() -> None:
    assert mean_pass_at_k([0, 1, 4], 4, 1) == pytest.approx((0 + 0.25 + 1) / 3)
    with pytest.raises(ValueError, match="at least one prompt"):
        mean_pass_at_k([], 4, 1)
