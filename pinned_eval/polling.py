"""One way to wait for a condition: `poll_until` / `apoll_until` (tenacity), not hand-written deadline loops.

Contract:
- `check()` is called at once, then every `interval_s` seconds, until it returns a value that is
  neither None nor False; that value is returned.
- an exception raised by `check` propagates at once (a check that sees a dead process raises);
- when `timeout_s` has passed, `PollTimeout` (a `TimeoutError`) is raised; its message is `what`
  (or `what()` evaluated then, so it can name the last thing seen).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tenacity import AsyncRetrying, RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

T = TypeVar("T")


class PollTimeout(TimeoutError):
    """The condition did not hold within the timeout."""


def _not_yet(value: Any) -> bool:
    return value is None or value is False


def _message(what: str | Callable[[], str], timeout_s: float) -> str:
    text = what() if callable(what) else what
    return f"{text} (after {timeout_s:g}s)"


def poll_until(
    check: Callable[[], T | None], *, timeout_s: float, interval_s: float = 0.2, what: str | Callable[[], str]
) -> T:
    """Call `check` until it returns a value (see the module contract)."""
    retrying = Retrying(
        stop=stop_after_delay(timeout_s), wait=wait_fixed(interval_s), retry=retry_if_result(_not_yet), reraise=True
    )
    try:
        return retrying(check)  # type: ignore[return-value]  # None/False are retried, never returned
    except RetryError:
        raise PollTimeout(_message(what, timeout_s)) from None


async def apoll_until(
    check: Callable[[], Awaitable[T | None]],
    *,
    timeout_s: float,
    interval_s: float = 0.2,
    what: str | Callable[[], str],
) -> T:
    """`poll_until` for an async `check`, sleeping with asyncio."""
    retrying = AsyncRetrying(
        stop=stop_after_delay(timeout_s), wait=wait_fixed(interval_s), retry=retry_if_result(_not_yet), reraise=True
    )
    try:
        return await retrying(check)
    except RetryError:
        raise PollTimeout(_message(what, timeout_s)) from None
