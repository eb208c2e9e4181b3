"""`FullyAsyncProducer`: a persistent rollout producer that the trainer drains one batch at a time.

Framework-agnostic; the caller supplies
- `generate_group(prompt_group, sample_done)`: roll out one prompt group (n samples) and return
  the finished group. Under `sample` granularity `sample_done` is a callable to invoke once per
  finished sample (success, error or cancellation) so its slot is backfilled before the whole
  group returns; under `group` granularity it is None. Extra or missing calls are harmless: a
  group's unreported samples are released when the group returns.
- a data source: `get_group()` → one flat prompt group; `recycle(group)` takes a reset prompt
  group back (both may be sync or async). `get_group` runs on the worker, so it must not block
  indefinitely (an exhausted source should raise: the next drain then fails with that error).
- optionally a dynamic filter `keep(group) -> bool | FilterVerdict` and an in-place sample filter
  over the assembled batch.

Invariants:
- One worker task, started lazily on the caller's running loop at the first `get_batch`; every
  later `get_batch` must run on that loop. It submits while the gate is open and there is
  capacity: at most `max_in_flight_groups` groups (`rollout_batch_size`, or
  `max(1, max_concurrent_samples // n)`), counted per group or per finished sample.
- Finished groups go to the buffer in completion order; a full buffer blocks the worker, which
  stops submission (backpressure). Put-time filters: aborted → unused handler (`retry` resets the
  original flat prompt group and returns it to the data source, `drop` discards it), dynamic-filter
  reject → dropped, never recycled. Get-time filter: staleness vs `set_weight_version(v)`.
- `get_batch()` returns exactly `rollout_batch_size` groups of `n_samples_per_prompt` entries,
  sorted by the first sample's index, plus the window's metrics. A failed group kills the worker;
  the next drain raises that exception even with groups buffered. A warning is logged every
  `stall_warning_s` without a finished group. A cancelled `get_batch` keeps what it collected for
  the next one.
- `close()` cancels the worker and every in-flight group and waits for them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer_integration.gate import ProducerGate
from trainer_integration.producer_config import (
    DataSource,
    GenerateGroup,
    ProducerConfig,
    RolloutBatch,
    SampleDone,
)
from trainer_integration.rollout_buffer import (
    PREFIX,
    BufferItem,
    BufferSpec,
    DataBuffer,
    DefaultDataBuffer,
    DynamicFilter,
    Group,
    first_sample,
    iter_samples,
)

logger = logging.getLogger(__name__)

__all__ = ["DataSource", "FullyAsyncProducer", "GenerateGroup", "ProducerConfig", "RolloutBatch", "SampleDone"]


@dataclass
class _Ticket:
    prompt_group: Group
    unreported: int  # samples of this group still holding a slot


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class FullyAsyncProducer:
    def __init__(
        self,
        config: ProducerConfig,
        generate_group: GenerateGroup,
        data_source: DataSource,
        *,
        gate: ProducerGate | None = None,
        dynamic_filter: DynamicFilter | None = None,
        sample_filter: Callable[[list[Group]], None] | None = None,
        buffer_factory: Callable[[BufferSpec], DataBuffer] = DefaultDataBuffer,
    ) -> None:
        self.config = config
        self.gate = gate or ProducerGate()
        self._generate_group = generate_group
        self._data_source = data_source
        self._dynamic_filter = dynamic_filter
        self._sample_filter = sample_filter
        self._buffer_factory = buffer_factory
        self._buffer: DataBuffer | None = None
        self._worker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._active: dict[asyncio.Task[BufferItem], _Ticket] = {}
        self._completed: deque[asyncio.Task[BufferItem]] = deque()
        self._samples_in_flight = 0
        self._weight_version: int | None = None
        self._draining = False
        self._closed = False
        self._pending_recycles: set[asyncio.Task[Any]] = set()
        self._carry: list[Group] = []
        self._reset_window()

    # ---- trainer-facing API -------------------------------------------------------------------

    def set_weight_version(self, version: int | None) -> None:
        """The engines' current weight version (after each broadcast); None disables staleness."""
        self._weight_version = version

    @property
    def started(self) -> bool:
        return self._worker is not None

    @property
    def in_flight_groups(self) -> int:
        return len(self._active)

    async def get_batch(self) -> RolloutBatch:
        if self._closed:
            raise RuntimeError("producer is closed")
        if self._draining:
            raise RuntimeError("get_batch is already running; drains must not overlap")
        self._draining = True
        try:
            self._ensure_started()
            return await self._drain()
        finally:
            self._draining = False

    async def close(self) -> None:
        self._closed = True
        tasks: list[asyncio.Task[Any]] = [*self._active, *self._pending_recycles]
        if self._worker is not None:
            tasks.append(self._worker)
            self.gate.remove_open_listener(self._wake_worker)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._active.clear()

    async def __aenter__(self) -> FullyAsyncProducer:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    # ---- consumer -----------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._worker is not None:
            if loop is not self._loop:
                raise RuntimeError("get_batch called on a different event loop than the one running the producer")
            return
        self._loop = loop
        self._wake = asyncio.Event()
        if self._buffer is None:
            spec = BufferSpec(
                capacity=self.config.buffer_capacity,
                max_weight_staleness=self.config.max_weight_staleness,
                unused_handler=self._handle_unused,
                dynamic_filter=self._dynamic_filter,
            )
            self._buffer = self._buffer_factory(spec)
        self.gate.add_open_listener(self._wake_worker)
        self._worker = loop.create_task(self._run(), name="fully-async-rollout-worker")
        logger.info(
            "started fully-async rollout worker (in-flight %d groups, buffer %d groups, %s granularity)",
            self.config.max_in_flight_groups,
            self.config.buffer_capacity,
            self.config.submission_granularity,
        )

    async def _drain(self) -> RolloutBatch:
        t0 = time.monotonic()
        groups, self._carry = self._carry, []
        try:
            await self._collect_watching_worker(groups)
        except asyncio.CancelledError:
            self._carry = groups  # a cancelled drain loses nothing: the next one starts with these
            raise
        wait_s = time.monotonic() - t0
        groups.sort(key=lambda g: first_sample(g).index)
        if self._sample_filter is not None:
            self._sample_filter(groups)
        logger.debug(
            "drained %d groups (first index %s, last index %s) in %.3fs",
            len(groups),
            first_sample(groups[0]).index,
            first_sample(groups[-1]).index,
            wait_s,
        )
        return RolloutBatch(groups=groups, metrics=self._metrics(wait_s, len(groups)))

    async def _collect_watching_worker(self, groups: list[Group]) -> None:
        """Fill `groups` from the buffer while watching the worker (one task per drain, not per group)."""
        worker = self._worker
        assert worker is not None
        if worker.done():  # a dead worker fails the step even with a backlog
            raise self._worker_failure(worker)
        collect = asyncio.ensure_future(self._collect(groups))
        try:
            seen = 0
            while True:
                await asyncio.wait(
                    {collect, worker}, timeout=self.config.stall_warning_s, return_when=asyncio.FIRST_COMPLETED
                )
                if worker.done():  # checked first, as above
                    raise self._worker_failure(worker)
                if collect.done():
                    collect.result()
                    return
                if len(groups) == seen:
                    logger.warning("No completed rollout groups for %.1fs", self.config.stall_warning_s)
                seen = len(groups)
        finally:
            if not collect.done():
                collect.cancel()

    async def _collect(self, groups: list[Group]) -> None:
        buffer, n = self._buffer, self.config.n_samples_per_prompt
        assert buffer is not None
        while len(groups) < self.config.rollout_batch_size:
            item = await buffer.get(current_version=self._weight_version)
            if len(item.group) != n:
                raise RuntimeError(f"generated group has {len(item.group)} entries, expected n_samples_per_prompt={n}")
            groups.append(item.group)

    @staticmethod
    def _worker_failure(worker: asyncio.Task[None]) -> BaseException:
        if worker.cancelled():
            return RuntimeError("fully-async rollout worker was cancelled")
        exc = worker.exception()
        return exc if exc is not None else RuntimeError("fully-async rollout worker exited without an exception")

    # ---- producer -----------------------------------------------------------------------------

    def _has_capacity(self) -> bool:
        budget = self.config.max_in_flight_groups
        if self.config.submission_granularity == "group":
            return len(self._active) < budget
        n = self.config.n_samples_per_prompt
        return self._samples_in_flight + n <= budget * n

    def _wake_worker(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._buffer is not None and self._wake is not None
        buffer, wake, gate = self._buffer, self._wake, self.gate
        try:
            await self._loop_forever(buffer, wake, gate)
        except BaseException:
            for task in self._active:  # nobody will collect them now
                task.cancel()
            raise

    async def _loop_forever(self, buffer: DataBuffer, wake: asyncio.Event, gate: ProducerGate) -> None:
        while True:
            while self._completed:
                task = self._completed.popleft()
                item = task.result()  # a failed group kills the worker; the drain re-raises it
                self._w_produced += 1
                await buffer.put(item)
            while gate.is_open and self._has_capacity():
                await self._submit_one()
            if self._completed:
                continue
            if not self._active and not gate.is_open:
                await gate.wait_open()
                continue
            wake.clear()
            await wake.wait()

    async def _submit_one(self) -> None:
        prompt_group: Group = await _maybe_await(self._data_source.get_group())
        n = self.config.n_samples_per_prompt
        if len(prompt_group) != n:
            raise ValueError(f"data source returned a group of {len(prompt_group)}, expected n_samples_per_prompt={n}")
        ticket = _Ticket(prompt_group=prompt_group, unreported=n)
        self._samples_in_flight += n
        task = asyncio.ensure_future(self._generate(ticket))
        self._active[task] = ticket
        task.add_done_callback(self._on_group_done)
        self._w_submitted += 1

    async def _generate(self, ticket: _Ticket) -> BufferItem:
        sample_done = None
        if self.config.submission_granularity == "sample":
            sample_done = functools.partial(self._on_sample_done, ticket)
        group = await self._generate_group(ticket.prompt_group, sample_done)
        return BufferItem(prompt_group=ticket.prompt_group, group=group)

    def _on_sample_done(self, ticket: _Ticket) -> None:
        if ticket.unreported > 0:
            ticket.unreported -= 1
            self._samples_in_flight -= 1
            self._wake_worker()

    def _on_group_done(self, task: asyncio.Task[BufferItem]) -> None:
        ticket = self._active.pop(task, None)
        if ticket is None:  # cleared by close()
            return
        self._samples_in_flight -= ticket.unreported
        ticket.unreported = 0
        self._completed.append(task)
        self._wake_worker()

    # ---- unused groups ------------------------------------------------------------------------

    def _handle_unused(self, prompt_group: Group) -> None:
        if self.config.unused_handler == "drop":
            self._w_dropped += 1
            return
        for sample in iter_samples(prompt_group):
            sample.reset_for_retry()
        result = self._data_source.recycle(prompt_group)
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._pending_recycles.add(task)
            task.add_done_callback(self._pending_recycles.discard)
        self._w_recycled += 1

    # ---- metrics ------------------------------------------------------------------------------

    def _reset_window(self) -> None:
        self._w_submitted = 0
        self._w_produced = 0
        self._w_recycled = 0
        self._w_dropped = 0

    def _metrics(self, wait_s: float, consumed: int) -> dict[str, float]:
        assert self._buffer is not None
        m = self._buffer.get_metrics()
        m.update(
            {
                PREFIX + "submitted_groups": float(self._w_submitted),
                PREFIX + "produced_groups": float(self._w_produced),
                PREFIX + "consumed_groups": float(consumed),
                PREFIX + "recycled_groups": float(self._w_recycled),
                PREFIX + "dropped_unused_groups": float(self._w_dropped),
                PREFIX + "in_flight_groups": float(len(self._active)),
                PREFIX + "in_flight_samples": float(self._samples_in_flight),
                PREFIX + "buffer_capacity": float(self.config.buffer_capacity),
                PREFIX + "drain_wait_seconds": wait_s,
                PREFIX + "gate_open": 1.0 if self.gate.is_open else 0.0,
            }
        )
        self._reset_window()
        return m
