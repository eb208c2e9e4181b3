"""Exact outcomes of the exception → skip mapping (killers of `make mutants` survivors, docs/testing.md)."""

from __future__ import annotations

import httpx
import pytest

from pinned_eval.fleet.errors import FleetError, GenerateRejected, WeightVersionMismatch
from pinned_eval.scoring.answers import RewardRefused
from pinned_eval.scoring.remote import RemoteRewardError
from pinned_eval.skip_mapping import skip_for


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (RemoteRewardError("rm down"), ("reward_unavailable", "rm down")),
        (RewardRefused("row 3 has no answer"), ("reward_unavailable", "row 3 has no answer")),
        (
            WeightVersionMismatch("5", "4", []),
            ("pin_violation", "response carries weight_version '4', expected '5'"),
        ),
        (FleetError("router gone"), ("unhealthy", "router gone")),
    ],
)
def test_a_skip_carries_the_exceptions_own_message(exc: Exception, expected: tuple[str, str]) -> None:
    assert skip_for(exc) == expected


def test_an_exception_without_a_message_is_named_by_its_repr() -> None:
    assert skip_for(FleetError()) == ("unhealthy", "FleetError()")
    assert skip_for(httpx.ReadTimeout("")) == ("unhealthy", "ReadTimeout('')")


@pytest.mark.parametrize(("status", "expected"), [(499, None), (500, "unhealthy"), (501, "unhealthy")])
def test_generate_rejected_is_a_skip_from_status_500_on(status: int, expected: str | None) -> None:
    mapped = skip_for(GenerateRejected("http://e", status, "body"))
    assert (mapped[0] if mapped else None) == expected
