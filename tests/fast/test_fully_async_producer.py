"""Behaviour of the reference fully-async producer, its buffer and the producer gate.

Ports miles' `tests/fast/rollout/test_fully_async_rollout.py` cases (names kept where they fit) to
`trainer_integration.producer`. Generation is a hand-written fake (it stands in for the GPU
engines): it records every call and blocks on asyncio Events the test controls. No timing: the
tests advance the loop with `sleep(0)` rounds until a recorded condition holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import pytest
from pydantic import ValidationError

from trainer_integration.gate import ProducerGate
from trainer_integration.producer import FullyAsyncProducer, ProducerConfig
from trainer_integration.rollout_buffer import (
    BufferItem,
    BufferSpec,
    DefaultDataBuffer,
    FilterVerdict,
    Group,
    Sample,
    SampleStatus,
)

pytestmark = pytest.mark.timeout(20)

N = 2  # samples per prompt
P = "rollout/fully_async/"


def make_group(group_index: int, status: str = SampleStatus.COMPLETED, version: int | None = None) -> list[Sample]:
    return [
        Sample(
            index=group_index * 10 + i,
            group_index=group_index,
            prompt=f"prompt {group_index}",
            response="ok",
            response_length=1,
            reward=1.0,
            status=status,
            weight_version=version,
        )
        for i in range(N)
    ]


class FakeSource:
    """Serves scripted groups first, then manufactures completed groups forever; records calls."""

    def __init__(self, scripted: list[Group] = (), version: int | None = None, reserve_recycled: bool = False):
        self.scripted = deque(scripted)
        self.version = version
        self.reserve_recycled = reserve_recycled
        self.next_index = 1000
        self.get_calls = 0
        self.recycled: list[Group] = []

    def get_group(self) -> Group:
        self.get_calls += 1
        if self.scripted:
            return self.scripted.popleft()
        self.next_index += 1
        return make_group(self.next_index, version=self.version)

    def recycle(self, group: Group) -> None:
        self.recycled.append(group)
        if self.reserve_recycled:
            self.scripted.appendleft(group)


class FakeGenerate:
    """Stands in for the engines: records calls and callbacks; `release` (if given) gates returns."""

    def __init__(
        self,
        release: asyncio.Event | None = None,
        result: Callable[[int, Group], Group] | None = None,
        per_call: dict[int, asyncio.Event] | None = None,
    ):
        self.release = release
        self.per_call = per_call or {}
        self.result = result
        self.calls: list[Group] = []
        self.callbacks: list[Callable[[], None] | None] = []
        self.cancelled = 0

    async def __call__(self, group: Group, sample_done: Callable[[], None] | None) -> Group:
        self.calls.append(group)
        self.callbacks.append(sample_done)
        call_no = len(self.calls)
        try:
            if call_no in self.per_call:
                await self.per_call[call_no].wait()
            elif self.release is not None:
                await self.release.wait()
            else:
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return self.result(call_no, group) if self.result else group


async def settle(rounds: int = 30) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def until(pred: Callable[[], bool], rounds: int = 2000) -> None:
    for _ in range(rounds):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def make_producer(source: FakeSource, generate: FakeGenerate, **cfg) -> FullyAsyncProducer:
    kwargs = {k: cfg.pop(k) for k in ("gate", "dynamic_filter", "sample_filter", "buffer_factory") if k in cfg}
    cfg.setdefault("rollout_batch_size", 2)
    cfg.setdefault("n_samples_per_prompt", N)
    return FullyAsyncProducer(ProducerConfig(**cfg), generate, source, **kwargs)


# ---- ported from miles ------------------------------------------------------------------------


async def test_drain_collects_batch_sorted_with_metrics() -> None:
    source = FakeSource(scripted=[make_group(3), make_group(1), make_group(2)])
    producer = make_producer(source, FakeGenerate(), rollout_batch_size=3)

    batch = await producer.get_batch()

    indices = [g[0].index for g in batch.groups]
    assert indices == [10, 20, 30]  # arrived 3, 1, 2
    assert all(len(g) == N for g in batch.groups)
    assert batch.metrics[P + "aborted_groups_filtered"] == 0
    assert batch.metrics[P + "stale_groups_filtered"] == 0
    assert batch.metrics[P + "consumed_groups"] == 3
    # The worker persists across calls; a second drain works on the same instance.
    second = await producer.get_batch()
    assert len(second.groups) == 3
    assert all(g[0].group_index > 1000 for g in second.groups)
    await producer.close()


async def test_eval_without_fleet_pauses_producer() -> None:
    release, eval_started, eval_release = asyncio.Event(), asyncio.Event(), asyncio.Event()
    source, generate = FakeSource(), FakeGenerate(release)
    producer = make_producer(source, generate, rollout_batch_size=2)

    async def dispatch_and_wait(step: int) -> dict[str, float]:
        eval_started.set()
        await eval_release.wait()
        return {"eval/ds": 0.5, "eval/step": float(step)}

    drain = asyncio.create_task(producer.get_batch())
    await until(lambda: len(generate.calls) == 2)
    submitted_before_eval = source.get_calls

    eval_task = asyncio.create_task(producer.gate.evaluate_now(7, dispatch_and_wait))
    await eval_started.wait()
    release.set()  # in-flight groups finish and are buffered, but nothing new is submitted
    await until(lambda: producer.in_flight_groups == 0)
    await settle()
    assert source.get_calls == submitted_before_eval

    eval_release.set()
    assert await eval_task == {"eval/ds": 0.5, "eval/step": 7.0}
    assert (await drain).groups
    await until(lambda: source.get_calls > submitted_before_eval)  # resumed
    await producer.close()


async def test_eval_does_not_start_the_producer() -> None:
    """An eval point (any posture) neither starts the worker nor consumes training prompts."""
    source = FakeSource()
    producer = make_producer(source, FakeGenerate())

    async def dispatch_and_wait(step: int) -> str:
        return f"point {step}"

    assert await producer.gate.evaluate_now(0, dispatch_and_wait) == "point 0"
    assert not producer.started
    assert source.get_calls == 0


async def test_aborted_group_recycled() -> None:
    aborted = make_group(1, status=SampleStatus.ABORTED, version=3)
    source = FakeSource(scripted=[aborted])
    producer = make_producer(source, FakeGenerate(), rollout_batch_size=1, unused_handler="retry")

    batch = await producer.get_batch()

    assert source.recycled == [aborted]
    # reset_for_retry cleared the generated fields so the prompt can be sampled again
    assert all(s.response == "" and s.weight_version is None and s.reward is None for s in aborted)
    assert all(s.prompt == "prompt 1" and s.status == SampleStatus.PENDING for s in aborted)
    assert batch.groups[0][0].group_index != 1
    assert batch.metrics[P + "aborted_groups_filtered"] == 1
    assert batch.metrics[P + "recycled_groups"] == 1
    await producer.close()


async def test_stale_group_recycled() -> None:
    stale = make_group(1, version=5)
    source = FakeSource(scripted=[stale], version=10)
    producer = make_producer(
        source, FakeGenerate(), rollout_batch_size=1, max_weight_staleness=2, unused_handler="retry"
    )
    producer.set_weight_version(10)

    batch = await producer.get_batch()

    assert source.recycled == [stale]
    assert batch.metrics[P + "stale_groups_filtered"] == 1
    assert batch.metrics[P + "max_staleness"] == 5
    assert batch.groups[0][0].weight_version == 10
    await producer.close()


async def test_stale_group_dropped_by_default() -> None:
    source = FakeSource(scripted=[make_group(1, version=5)], version=10)
    producer = make_producer(source, FakeGenerate(), rollout_batch_size=1, max_weight_staleness=2)
    producer.set_weight_version(10)

    batch = await producer.get_batch()

    assert source.recycled == []
    assert batch.metrics[P + "stale_groups_filtered"] == 1
    assert batch.metrics[P + "dropped_unused_groups"] == 1
    assert batch.metrics[P + "recycled_groups"] == 0
    await producer.close()


async def test_worker_error_propagates() -> None:
    def explode(_call: int, _group: Group) -> Group:
        raise RuntimeError("generation exploded")

    producer = make_producer(FakeSource(), FakeGenerate(result=explode))
    with pytest.raises(RuntimeError, match="generation exploded"):
        await producer.get_batch()
    with pytest.raises(RuntimeError, match="generation exploded"):  # and on every later drain
        await producer.get_batch()
    await producer.close()


async def test_worker_bounds_in_flight_groups() -> None:
    release = asyncio.Event()
    source, generate = FakeSource(), FakeGenerate(release)
    producer = make_producer(source, generate, rollout_batch_size=2)

    drain = asyncio.create_task(producer.get_batch())
    await until(lambda: len(generate.calls) == 2)
    await settle()
    assert source.get_calls == 2  # the in-flight bound, not more
    assert producer.in_flight_groups == 2

    release.set()
    assert len((await drain).groups) == 2
    await producer.close()


async def test_async_max_concurrent_samples_caps_in_flight_groups() -> None:
    release = asyncio.Event()
    source, generate = FakeSource(), FakeGenerate(release)
    # 3 samples // 2 per group -> 1 group in flight, below rollout_batch_size
    producer = make_producer(source, generate, rollout_batch_size=4, max_concurrent_samples=3)

    drain = asyncio.create_task(producer.get_batch())
    await until(lambda: len(generate.calls) == 1)
    await settle()
    assert source.get_calls == 1

    release.set()
    assert len((await drain).groups) == 4
    await producer.close()


async def test_worker_failure_beats_queued_groups() -> None:
    """A dead worker fails the step even when it left finished groups in the buffer."""

    def third_explodes(call: int, group: Group) -> Group:
        if call == 3:
            raise RuntimeError("generation exploded")
        return group

    generate = FakeGenerate(result=third_explodes)
    producer = make_producer(FakeSource(), generate, rollout_batch_size=1)
    assert len((await producer.get_batch()).groups) == 1
    await until(lambda: producer._worker is not None and producer._worker.done())
    assert len(producer._buffer) == 1  # call 2's group is still queued

    with pytest.raises(RuntimeError, match="generation exploded"):
        await producer.get_batch()
    await producer.close()


async def test_nested_group_recycles_the_flat_prompt_group() -> None:
    """A generate function may expand one trajectory into several samples; the retry must
    resubmit the flat prompt group the data source handed out."""
    prompt_group = make_group(1)
    source = FakeSource(scripted=[prompt_group], reserve_recycled=True)

    def expand_first(call: int, group: Group) -> Group:
        assert all(isinstance(s, Sample) for s in group), "resubmitted a nested group"
        if call > 1:
            return group
        return [[replace(s, status=SampleStatus.ABORTED), replace(s)] for s in group]

    generate = FakeGenerate(result=expand_first)
    producer = make_producer(source, generate, rollout_batch_size=1, unused_handler="retry")
    batch = await producer.get_batch()

    assert source.recycled == [prompt_group]
    assert source.recycled[0] is prompt_group
    assert generate.calls[1] is prompt_group  # resubmitted
    assert len(batch.groups) == 1
    await producer.close()


async def test_dynamic_filter_drops_group_without_recycling() -> None:
    source = FakeSource(scripted=[make_group(1)])

    def reject_group_1(group: Group) -> FilterVerdict:
        keep = group[0].group_index != 1
        return FilterVerdict(keep=keep, reason=None if keep else "rejected")

    producer = make_producer(
        source, FakeGenerate(), rollout_batch_size=1, unused_handler="retry", dynamic_filter=reject_group_1
    )
    batch = await producer.get_batch()

    assert len(batch.groups) == 1
    assert batch.groups[0][0].group_index != 1
    assert source.recycled == []  # unlike a recycle, a filtered group is not sampled again
    assert batch.metrics["rollout/dynamic_filter/drop_rejected"] == 1
    assert batch.metrics[P + "dynamic_filter_dropped_groups"] == 1
    await producer.close()


async def test_sample_filter_marks_samples_without_shrinking_the_batch() -> None:
    def mark_first_of_each_group(batch: list[Group]) -> None:
        for group in batch:
            group[0].remove_sample = True

    producer = make_producer(FakeSource(), FakeGenerate(), rollout_batch_size=2, sample_filter=mark_first_of_each_group)
    batch = await producer.get_batch()

    assert len(batch.groups) == 2
    assert [s.remove_sample for s in batch.groups[0]] == [True, False]
    await producer.close()


async def test_staleness_filter_off_before_the_first_weight_update() -> None:
    stale_looking = make_group(1, version=0)
    source = FakeSource(scripted=[stale_looking], version=50)
    producer = make_producer(source, FakeGenerate(), rollout_batch_size=1, max_weight_staleness=2)

    batch = await producer.get_batch()  # no set_weight_version yet

    assert batch.groups[0] is stale_looking
    assert source.recycled == []
    assert batch.metrics[P + "stale_groups_filtered"] == 0
    assert P + "max_staleness" not in batch.metrics
    await producer.close()


# ---- the buffer on its own --------------------------------------------------------------------


def make_buffer(capacity: int = 4, max_staleness: int | None = None) -> tuple[DefaultDataBuffer, list[Group]]:
    unused: list[Group] = []
    return DefaultDataBuffer(BufferSpec(capacity, max_staleness, unused.append)), unused


async def put_group(buffer: DefaultDataBuffer, group: Group) -> None:
    await buffer.put(BufferItem(prompt_group=group, group=group))


async def test_buffer_blocks_producer_when_full() -> None:
    buffer, _ = make_buffer(capacity=2)
    first, second, third = make_group(1), make_group(2), make_group(3)
    await put_group(buffer, first)
    await put_group(buffer, second)
    blocked = asyncio.create_task(put_group(buffer, third))
    await settle()
    assert not blocked.done()
    assert buffer.get_metrics()[P + "queue_size"] == 2

    assert (await buffer.get()).group is first  # FIFO
    await blocked
    assert [(await buffer.get()).group for _ in range(2)] == [second, third]


async def test_full_buffer_stops_submission() -> None:
    source, generate = FakeSource(), FakeGenerate()
    producer = make_producer(source, generate, rollout_batch_size=1, buffer_factor=2.0)
    await producer.get_batch()
    await settle(200)
    plateau = len(generate.calls)
    await settle(200)
    assert len(generate.calls) == plateau  # blocked on the full buffer, not spinning
    assert plateau <= 1 + 2 + 2  # drained + buffer capacity + one waiting to be put + one in flight
    batch = await producer.get_batch()
    assert batch.metrics[P + "queue_size"] >= 1
    await until(lambda: len(generate.calls) > plateau)  # consuming unblocked it
    await producer.close()


async def test_buffer_get_ignores_unknown_context_keys() -> None:
    buffer, _ = make_buffer()
    group = make_group(1, version=3)
    await put_group(buffer, group)
    assert (await buffer.get(current_version=4, rollout_id=7, unknown="x")).group is group


async def test_buffer_get_skips_groups_stale_at_consumption_time() -> None:
    buffer, unused = make_buffer(max_staleness=2)
    old, fresh = make_group(1, version=5), make_group(2, version=9)
    await put_group(buffer, old)
    await put_group(buffer, fresh)
    assert (await buffer.get(current_version=8)).group is fresh  # 8 - 5 = 3 > 2
    assert unused == [old]
    # the same group is fine when consumed at an earlier version: staleness is judged at get time
    again = make_group(3, version=5)
    await put_group(buffer, again)
    assert (await buffer.get(current_version=7)).group is again
    assert buffer.get_metrics()[P + "stale_groups_filtered"] == 1


async def test_buffer_staleness_metrics() -> None:
    buffer, _ = make_buffer()
    await put_group(buffer, make_group(1, version=2))
    assert P + "buffer_avg_staleness" not in buffer.get_metrics()  # no version seen yet
    await put_group(buffer, make_group(2, version=4))
    await put_group(buffer, make_group(3, version=6))

    await buffer.get(current_version=8)
    m = buffer.get_metrics()
    assert m[P + "avg_staleness"] == 6.0
    assert m[P + "max_staleness"] == 6.0
    assert m[P + "buffer_avg_staleness"] == 3.0  # 8-4, 8-6
    assert m[P + "buffer_max_staleness"] == 4.0
    assert P + "avg_staleness" not in buffer.get_metrics()  # the window was reset


async def test_custom_buffer_factory_replaces_default() -> None:
    built: list[BufferSpec] = []

    class CountingBuffer(DefaultDataBuffer):
        puts = 0

        def __init__(self, spec: BufferSpec) -> None:
            built.append(spec)
            super().__init__(spec)

        async def put(self, item: BufferItem) -> None:
            CountingBuffer.puts += 1
            await super().put(item)

    producer = make_producer(FakeSource(), FakeGenerate(), buffer_factory=CountingBuffer, buffer_factor=1.5)
    batch = await producer.get_batch()

    assert len(built) == 1
    assert built[0].unused_handler == producer._handle_unused
    assert built[0].capacity == 3
    assert CountingBuffer.puts >= len(batch.groups)
    await producer.close()


async def test_worker_defaults_to_sample_granularity() -> None:
    release = asyncio.Event()
    generate = FakeGenerate(release)
    producer = make_producer(FakeSource(), generate, rollout_batch_size=1)
    drain = asyncio.create_task(producer.get_batch())
    await until(lambda: len(generate.calls) == 1)

    sample_done = generate.callbacks[0]
    assert sample_done is not None
    sample_done()
    await settle()
    assert len(generate.calls) == 1  # one free slot is not a whole group
    sample_done()
    await until(lambda: len(generate.calls) == 2)  # backfilled before the first group returned
    for _ in range(3):
        sample_done()  # extra reports are harmless: they never free more than the group held
    await settle()
    assert len(generate.calls) == 2

    release.set()
    await drain
    await producer.close()


async def test_group_granularity_opts_the_worker_out_of_backfill() -> None:
    release = asyncio.Event()
    generate = FakeGenerate(release)
    producer = make_producer(FakeSource(), generate, rollout_batch_size=1, submission_granularity="group")
    drain = asyncio.create_task(producer.get_batch())
    await until(lambda: len(generate.calls) == 1)
    await settle()
    assert generate.callbacks == [None]
    assert len(generate.calls) == 1

    release.set()
    await drain
    await producer.close()


# ---- gate, lifecycle, config ------------------------------------------------------------------


async def test_gate_pauses_submissions_buffers_in_flight_and_resumes() -> None:
    release = asyncio.Event()
    source, generate = FakeSource(), FakeGenerate(release)
    gate = ProducerGate()
    producer = make_producer(source, generate, rollout_batch_size=2, max_concurrent_samples=N, gate=gate)
    first = asyncio.create_task(producer.get_batch())
    await until(lambda: len(generate.calls) == 1)

    async with gate.closed("test"):
        release.set()
        await until(lambda: producer.in_flight_groups == 0)
        await settle()
        assert len(generate.calls) == 1  # nothing new while closed
        assert not first.done()  # it needs a second group, which cannot be submitted yet

    batch = await first  # resumed after the gate reopened
    assert len(generate.calls) >= 2
    assert any(g is generate.calls[0] for g in batch.groups)  # the in-flight group was kept
    assert batch.metrics[P + "aborted_groups_filtered"] == 0
    assert generate.cancelled == 0  # nothing was aborted
    await producer.close()


async def test_gate_reopens_when_the_body_raises_or_is_cancelled() -> None:
    gate = ProducerGate()
    with pytest.raises(ValueError, match="eval failed"):
        async with gate.closed():
            assert not gate.is_open
            raise ValueError("eval failed")
    assert gate.is_open

    entered = asyncio.Event()

    async def hold() -> None:
        async with gate.closed():
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(hold())
    await entered.wait()
    assert not gate.is_open
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.is_open


async def test_evaluate_now_failure_resumes_the_producer() -> None:
    source, generate = FakeSource(), FakeGenerate()
    producer = make_producer(source, generate, rollout_batch_size=1)
    await producer.get_batch()

    async def failing_dispatch(step: int) -> None:
        raise RuntimeError(f"point {step} failed")

    with pytest.raises(RuntimeError, match="point 3 failed"):
        await producer.gate.evaluate_now(3, failing_dispatch)
    assert producer.gate.is_open
    assert len((await producer.get_batch()).groups) == 1
    await producer.close()


async def test_nested_gate_closes_reopen_at_the_last_exit() -> None:
    gate = ProducerGate()
    async with gate.closed():
        async with gate.closed():
            pass
        assert not gate.is_open
    assert gate.is_open


async def test_stall_warning_is_logged_while_starved(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()
    generate = FakeGenerate(release)
    producer = make_producer(FakeSource(), generate, rollout_batch_size=1, stall_warning_s=0.001)
    caplog.set_level(logging.WARNING, logger="trainer_integration.producer")
    drain = asyncio.create_task(producer.get_batch())
    for _ in range(200):
        if any("No completed rollout groups" in r.message for r in caplog.records):
            break
        await asyncio.sleep(0.001)
    assert any("No completed rollout groups for 0.0s" in r.message for r in caplog.records)
    release.set()
    assert len((await drain).groups) == 1
    await producer.close()


async def test_close_cancels_in_flight_groups() -> None:
    generate = FakeGenerate(asyncio.Event())
    producer = make_producer(FakeSource(), generate, rollout_batch_size=2)
    drain = asyncio.create_task(producer.get_batch())
    await until(lambda: len(generate.calls) == 2)
    await producer.close()
    assert generate.cancelled == 2
    with pytest.raises(RuntimeError, match="cancelled"):
        await drain
    with pytest.raises(RuntimeError, match="closed"):
        await producer.get_batch()


async def test_cancelled_drain_keeps_its_groups_for_the_next_one() -> None:
    second = asyncio.Event()
    generate = FakeGenerate(per_call={2: second})
    producer = make_producer(FakeSource(), generate, rollout_batch_size=2, max_concurrent_samples=N)
    drain = asyncio.create_task(producer.get_batch())
    await until(lambda: len(generate.calls) == 2)  # call 1 finished (and was collected), call 2 blocks
    await settle()
    drain.cancel()
    with pytest.raises(asyncio.CancelledError):
        await drain

    second.set()
    batch = await producer.get_batch()
    assert [g[0].group_index for g in batch.groups] == [1001, 1002]
    await producer.close()


def test_get_batch_on_another_loop_is_refused() -> None:
    producer = make_producer(FakeSource(), FakeGenerate(), rollout_batch_size=1)
    asyncio.run(producer.get_batch())
    with pytest.raises(RuntimeError, match="different event loop"):
        asyncio.run(producer.get_batch())


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"rollout_batch_size": 0}, "rollout_batch_size"),
        ({"max_concurrent_samples": 1, "n_samples_per_prompt": 2}, "max_concurrent_samples"),
        ({"buffer_factor": 0.1}, "buffer_factor"),
        ({"unused_handler": "keep"}, "unused_handler"),
        ({"max_weight_staleness": -1}, "max_weight_staleness"),
        ({"submission_granularity": "token"}, "submission_granularity"),
    ],
)
def test_config_errors_name_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        ProducerConfig(**{"rollout_batch_size": 2, **overrides})


def test_config_in_flight_bound() -> None:
    assert ProducerConfig(rollout_batch_size=8).max_in_flight_groups == 8
    assert (
        ProducerConfig(rollout_batch_size=8, n_samples_per_prompt=4, max_concurrent_samples=10).max_in_flight_groups
        == 2
    )
    assert ProducerConfig(rollout_batch_size=3, buffer_factor=2.5).buffer_capacity == 7
