"""pass@k and the eval metrics (pinned_eval/scoring/passk.py, metrics.py): exact values and errors
that `make mutants` found unchecked (docs/testing.md)."""

from __future__ import annotations

import pytest

from pinned_eval.scoring.passk import mean_pass_at_k, pass_at_k_values


def test_the_errors_name_the_bad_argument() -> None:
    with pytest.raises(ValueError, match=r"^n must be >= 1, got 0$"):
        pass_at_k_values(0)
    with pytest.raises(ValueError, match=r"^mean_pass_at_k needs at least one prompt$"):
        mean_pass_at_k([], 4, 1)
