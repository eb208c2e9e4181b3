"""Unbiased pass@k (Chen et al., 2021, "Evaluating Large Language Models Trained on Code").

pass@k for one prompt with n samples of which c are correct is 1 - C(n-c, k) / C(n, k), computed
in the numerically stable product form 1 - prod_{i=n-c+1}^{n} (1 - k/i) (no big binomials).
A dataset's pass@k is the mean over prompts, every prompt having the same n (as in miles).
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n is correct."""
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n, 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k_values(n: int) -> list[int]:
    """k = 1, 2, 4, … ≤ n (powers of two, as miles logs them)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def mean_pass_at_k(correct_counts: Sequence[int], n: int, k: int) -> float:
    """Mean pass@k over prompts, given each prompt's number of correct samples out of n."""
    if not correct_counts:
        raise ValueError("mean_pass_at_k needs at least one prompt")
    return sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)
