"""Rollout samples, groups and the bounded buffer between a fully-async producer and the trainer.

Contract (no Prefect, no torch; pure asyncio):
- A *group* is what one prompt turns into: `n_samples_per_prompt` entries, each a sample or, when a
  generate function expands one trajectory into several samples, a list of samples. The producer
  keeps the *flat prompt group* the data source handed out next to the generated group, so a retry
  always resubmits prompts, never a nested result.
- Samples are duck-typed (`SampleLike`): `index`, `status`, `weight_version` (the oldest engine
  weight version that produced it, None if unknown) and `reset_for_retry()`. `Sample` is the
  reference implementation; statuses compare as plain strings (`"aborted"`).
- `DataBuffer` is the replaceable buffer contract: `put(item)`, `get(**context)` (waits; unknown
  context keys are ignored), `get_metrics()` (window counters reset on each call).
- `DefaultDataBuffer` is a FIFO of at most `capacity` groups. `put` filters first: a group with an
  aborted sample goes to the unused handler (drop or retry), a dynamic-filter reject is dropped
  (never recycled); then it waits while the buffer is full, which blocks the producer. `get`
  judges staleness at consumption time against the version the trainer passes
  (`current_version - oldest version in the group`): above `max_weight_staleness` → unused
  handler, next group. A None version on either side disables the filter for that group.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

PREFIX = "rollout/fully_async/"
DYNAMIC_FILTER_PREFIX = "rollout/dynamic_filter/drop_"


class SampleStatus(enum.StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


@runtime_checkable
class SampleLike(Protocol):
    index: int
    status: str
    weight_version: int | None

    def reset_for_retry(self) -> None: ...


@dataclass
class Sample:
    """One trajectory. Identity/prompt fields survive `reset_for_retry`; generated fields do not."""

    index: int
    prompt: Any
    group_index: int = 0
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    reward: float | None = None
    status: str = SampleStatus.PENDING
    weight_version: int | None = None
    remove_sample: bool = False

    def reset_for_retry(self) -> None:
        self.response = ""
        self.response_length = 0
        self.reward = None
        self.status = SampleStatus.PENDING
        self.weight_version = None
        self.remove_sample = False


Group = list[Any]  # entries: SampleLike | list[SampleLike]
UnusedHandler = Callable[[Group], None]


@dataclass(frozen=True)
class FilterVerdict:
    keep: bool
    reason: str | None = None


DynamicFilter = Callable[[Group], "bool | FilterVerdict"]


@dataclass(frozen=True)
class BufferItem:
    prompt_group: Group  # flat, as the data source handed it out (for recycling)
    group: Group  # what generation returned


def iter_samples(group: Group) -> Iterator[SampleLike]:
    for entry in group:
        if isinstance(entry, list):
            yield from entry
        else:
            yield entry


def first_sample(group: Group) -> SampleLike:
    entry = group[0]
    return entry[0] if isinstance(entry, list) else entry


def group_oldest_version(group: Group) -> int | None:
    versions = [s.weight_version for s in iter_samples(group) if s.weight_version is not None]
    return min(versions) if versions else None


def is_aborted(group: Group) -> bool:
    return any(s.status == SampleStatus.ABORTED for s in iter_samples(group))


@dataclass(frozen=True)
class BufferSpec:
    """Everything a buffer implementation is built from (what `buffer_factory` receives)."""

    capacity: int
    max_weight_staleness: int | None
    unused_handler: UnusedHandler
    dynamic_filter: DynamicFilter | None = None


class DataBuffer(Protocol):
    async def put(self, item: BufferItem) -> None: ...

    async def get(self, **context: Any) -> BufferItem: ...

    def get_metrics(self) -> dict[str, float]: ...


class DefaultDataBuffer:
    """FIFO of finished groups; see the module docstring for the filters and their order."""

    def __init__(self, spec: BufferSpec) -> None:
        if spec.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {spec.capacity}")
        self.spec = spec
        self._items: deque[BufferItem] = deque()
        self._cond = asyncio.Condition()
        self._last_version: int | None = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._aborted = 0
        self._stale = 0
        self._filter_drops: dict[str, int] = {}
        self._consumed_staleness: list[int] = []

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, item: BufferItem) -> None:
        if is_aborted(item.group):
            self._aborted += 1
            self.spec.unused_handler(item.prompt_group)
            return
        if self.spec.dynamic_filter is not None:
            verdict = self.spec.dynamic_filter(item.group)
            if isinstance(verdict, bool):
                verdict = FilterVerdict(keep=verdict)
            if not verdict.keep:
                reason = verdict.reason or "filtered"
                self._filter_drops[reason] = self._filter_drops.get(reason, 0) + 1
                return
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._items) < self.spec.capacity)
            self._items.append(item)
            self._cond.notify_all()

    async def get(self, current_version: int | None = None, **_context: Any) -> BufferItem:
        if current_version is not None:
            self._last_version = current_version
        max_staleness = self.spec.max_weight_staleness
        while True:
            async with self._cond:
                await self._cond.wait_for(lambda: bool(self._items))
                item = self._items.popleft()
                self._cond.notify_all()  # a producer blocked on a full buffer may go on
            oldest = group_oldest_version(item.group)
            if current_version is None or oldest is None:
                return item
            staleness = current_version - oldest
            self._consumed_staleness.append(staleness)
            if max_staleness is None or staleness <= max_staleness:
                return item
            logger.info(
                "dropping stale group (index %s): staleness %d > max_weight_staleness %d",
                first_sample(item.group).index,
                staleness,
                max_staleness,
            )
            self._stale += 1
            self.spec.unused_handler(item.prompt_group)

    def get_metrics(self) -> dict[str, float]:
        m: dict[str, float] = {
            PREFIX + "queue_size": float(len(self._items)),
            PREFIX + "aborted_groups_filtered": float(self._aborted),
            PREFIX + "stale_groups_filtered": float(self._stale),
        }
        for reason, count in self._filter_drops.items():
            m[DYNAMIC_FILTER_PREFIX + reason] = float(count)
        m[PREFIX + "dynamic_filter_dropped_groups"] = float(sum(self._filter_drops.values()))
        if self._consumed_staleness:
            m[PREFIX + "avg_staleness"] = sum(self._consumed_staleness) / len(self._consumed_staleness)
            m[PREFIX + "max_staleness"] = float(max(self._consumed_staleness))
        if self._last_version is not None:
            buffered = [group_oldest_version(item.group) for item in self._items]
            known = [self._last_version - v for v in buffered if v is not None]
            if known:
                m[PREFIX + "buffer_avg_staleness"] = sum(known) / len(known)
                m[PREFIX + "buffer_max_staleness"] = float(max(known))
        self._reset_window()
        return m
