"""Uncertainty and multi-sample statistics of one dataset at one point (docs/metrics.md).

Every statistic treats the *prompt* as the unit: a prompt's n samples are correlated (same
question), so the spread is taken over per-prompt mean rewards m_1..m_P (None counts as 0.0, as in
`eval/<ds>`). With the same n for every prompt, mean(m) equals `eval/<ds>`.

- `stderr(m)`: sample standard deviation of m (ddof 1) over sqrt(P), as lm-eval and Inspect
  print it; needs P >= 2.
- `bootstrap_ci(m)`: percentile bootstrap 95% interval of mean(m): `BOOTSTRAP_RESAMPLES`
  resamples of P prompts drawn with replacement from a generator seeded with `BOOTSTRAP_SEED`
  (same input, same interval, on every machine); the bounds are the inverted-CDF 2.5% and 97.5%
  quantiles of the resampled means, so each bound is a mean some resample reached.
- `pass_hat_k(n, c, k)` (tau-bench's pass^k): probability that k samples drawn without replacement
  from n, c of them correct, are all correct: C(c, k) / C(n, k).
- `majority_at_k(answers, correct, k)`: the vote of the first k samples (lighteval's maj@k): the
  most frequent answer among them, ties to the answer seen first; 1.0 when that answer's first
  sample is correct.
- `vote_key(response)`: what a sample votes for: the content of its last `\\boxed{}` when it has
  one, else the response stripped of surrounding whitespace.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from pinned_eval.scoring.answers import last_boxed

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CI_LEVEL = 0.95


def stderr(means: Sequence[float]) -> float:
    """Standard error of the mean of per-prompt means (ddof 1); needs at least two prompts."""
    if len(means) < 2:
        raise ValueError(f"stderr needs at least 2 prompts, got {len(means)}")
    return float(np.std(np.asarray(means, dtype=float), ddof=1) / math.sqrt(len(means)))


def bootstrap_ci(
    means: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> tuple[float, float]:
    """Seeded percentile bootstrap `CI_LEVEL` interval of the mean of `means` (see the module docstring)."""
    if not means:
        raise ValueError("bootstrap_ci needs at least one prompt")
    values = np.asarray(means, dtype=float)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(values), size=(resamples, len(values)))
    resampled = values[draws].mean(axis=1)
    tail = (1.0 - CI_LEVEL) / 2
    low, high = np.quantile(resampled, [tail, 1.0 - tail], method="inverted_cdf")
    return float(low), float(high)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """C(c, k) / C(n, k): all k of k samples drawn without replacement from n are correct."""
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_hat_k needs n >= 1, 0 <= c <= n, 1 <= k <= n; got n={n}, c={c}, k={k}")
    return math.comb(c, k) / math.comb(n, k)


def vote_key(response: str) -> str:
    """The answer a sample votes for: its last `\\boxed{}` content, else the stripped response."""
    boxed = last_boxed(response)
    return boxed.strip() if boxed is not None else response.strip()


def majority_at_k(answers: Sequence[str], correct: Sequence[bool], k: int) -> float:
    """1.0 when the majority answer of the first k samples is correct (ties: first seen wins)."""
    if len(answers) != len(correct) or not 1 <= k <= len(answers):
        raise ValueError(f"majority_at_k needs 1 <= k <= n and one verdict per answer; got k={k}, "
                         f"{len(answers)} answers, {len(correct)} verdicts")
    first = answers[:k]
    counts = Counter(first)
    top = max(counts.values())
    winner = next(a for a in first if counts[a] == top)  # earliest of the most frequent
    return 1.0 if correct[first.index(winner)] else 0.0
