"""Prove a wait for an in-flight slot by the order of events, never by a duration.

`SlotHolder` holds one slot of a run's `eval-inflight-<run>` limit in a thread until released.
`refusals(order, label)` records, into `order`, the first 423 the Prefect server answers to a
request for a slot made in this process while it is active (a point that is waiting), and sets
the event it yields; `release_when_refused` lets the holder go only after that refusal. A test
then asserts e.g. `["held", "refused", "releasing", "admitted"]`: the waiter asked while the
slot was held and got in only after the release.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import httpx
from prefect.client.orchestration import PrefectClient

from tasks.admission import admitted


class SlotHolder:
    """One slot of `run`'s in-flight limit (size `max_in_flight`), held in a thread until `release()`."""

    def __init__(self, run: str, step: int, order: list[str], *, max_in_flight: int = 1) -> None:
        self.order = order
        self.held, self._release = threading.Event(), threading.Event()
        self.released_at: float | None = None
        self._thread = threading.Thread(target=self._hold, args=(run, step, max_in_flight), name="slot-holder")

    def _hold(self, run: str, step: int, max_in_flight: int) -> None:
        with admitted(run, step, policy="skip", final=False, max_in_flight=max_in_flight):
            self.order.append("held")
            self.held.set()
            self._release.wait(120)
            self.order.append("releasing")
            self.released_at = time.monotonic()

    def __enter__(self) -> SlotHolder:
        self._thread.start()
        if not self.held.wait(60):
            raise TimeoutError("the slot holder never got its slot")
        return self

    def release(self) -> None:
        self._release.set()

    def release_when(self, event: threading.Event) -> None:
        """Release from a helper thread as soon as `event` is set (or after 120 s)."""
        threading.Thread(target=lambda: (event.wait(120), self.release()), name="slot-releaser").start()

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._thread.join(60)


class Refusal(threading.Event):
    at: float | None = None  # time.monotonic() of the first 423


@contextmanager
def refusals(order: list[Any], label: object) -> Iterator[Refusal]:
    """Record the first 423 (slot refused: the caller waits or skips) into `order` as `label`."""
    refused = Refusal()
    increment = PrefectClient.increment_concurrency_slots_with_lease

    async def recording(self: PrefectClient, *args: Any, **kwargs: Any) -> httpx.Response:
        try:
            return await increment(self, *args, **kwargs)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 423 and not refused.is_set():
                refused.at = time.monotonic()
                order.append(label)
                refused.set()
            raise

    try:
        with mock.patch.object(PrefectClient, "increment_concurrency_slots_with_lease", recording):
            yield refused
    finally:
        refused.set()  # a release waiting on it goes ahead
