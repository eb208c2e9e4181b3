"""`ProducerGate`: pause a fully-async producer's NEW submissions while a shared-engine eval runs.

Contract:
- `async with gate.closed(reason):` closes the gate for the body. The producer checks the gate
  before every submission, so no new group is submitted while it is closed; groups already in
  flight keep running and land in the buffer; nothing is aborted.
- The gate reopens in `finally`: when the body returns, raises, or is cancelled. Closes nest
  (a counter): the gate is open again only when the last `closed()` exits.
- `evaluate_now(step, dispatch_and_wait)` is the shared-posture eval point: close the gate, await
  the caller's coroutine (EvalClient plugs its dispatch-and-wait of a `shared` point here, so the
  weight version is pinned by call order), reopen, return its result.
- Listeners (`add_open_listener`) are called synchronously on every reopen; the producer uses one
  to wake its worker without polling.
The gate holds no event loop: one instance may be used from whichever loop runs the producer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol, TypeVar

logger = logging.getLogger(__name__)

R_co = TypeVar("R_co", covariant=True)


class DispatchAndWait(Protocol[R_co]):
    """The coupling to EvalClient: dispatch the eval point for `step` and wait for its result."""

    def __call__(self, step: int) -> Awaitable[R_co]: ...


class ProducerGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._closers = 0
        self._listeners: list[Callable[[], None]] = []
        self.times_closed = 0

    @property
    def is_open(self) -> bool:
        return self._closers == 0

    async def wait_open(self) -> None:
        await self._open.wait()

    def add_open_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def remove_open_listener(self, callback: Callable[[], None]) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    @asynccontextmanager
    async def closed(self, reason: str = "") -> AsyncIterator[None]:
        self._closers += 1
        self.times_closed += 1
        self._open.clear()
        logger.info("pausing rollout submissions%s", f" ({reason})" if reason else "")
        try:
            yield
        finally:
            self._closers -= 1
            if self._closers == 0:
                self._open.set()
                for callback in list(self._listeners):
                    callback()
                logger.info("resumed rollout submissions%s", f" ({reason})" if reason else "")

    async def evaluate_now(self, step: int, dispatch_and_wait: DispatchAndWait[R_co]) -> R_co:
        async with self.closed(f"shared-engine eval at step {step}"):
            return await dispatch_and_wait(step)
