"""`poll_until` / `apoll_until`: the one wait-for-a-condition helper of the library."""

from __future__ import annotations

import itertools

import pytest

from pinned_eval.polling import PollTimeout, apoll_until, poll_until


def test_returns_the_first_value_that_is_not_none_or_false() -> None:
    answers = iter([None, False, 0, "x"])
    calls = itertools.count()

    def check() -> object:
        next(calls)
        return next(answers)

    assert poll_until(check, timeout_s=5, interval_s=0, what="an answer") == 0  # 0 is a value, not "not yet"
    assert next(calls) == 3


def test_times_out_with_the_description_of_the_last_state() -> None:
    seen: list[int] = []

    def never() -> None:
        seen.append(1)
        return None

    with pytest.raises(PollTimeout, match=r"engine ready \(2 probes\)") as err:
        poll_until(never, timeout_s=0.05, interval_s=0.01, what=lambda: f"engine ready ({min(len(seen), 2)} probes)")
    assert isinstance(err.value, TimeoutError) and len(seen) >= 2


def test_an_error_in_the_check_propagates_at_once() -> None:
    calls: list[int] = []

    def dead() -> bool:
        calls.append(1)
        raise RuntimeError("process exited")

    with pytest.raises(RuntimeError, match="process exited"):
        poll_until(dead, timeout_s=30, what="never reached")
    assert calls == [1]


async def test_async_variant() -> None:
    answers = iter([None, None, 7])

    async def check() -> int | None:
        return next(answers)

    assert await apoll_until(check, timeout_s=5, interval_s=0, what="seven") == 7
    with pytest.raises(PollTimeout, match="nothing"):

        async def nothing() -> None:
            return None

        await apoll_until(nothing, timeout_s=0.03, interval_s=0.01, what="nothing")
