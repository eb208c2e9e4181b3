"""Overhead of `FullyAsyncProducer` per group vs a bare `asyncio.gather` over the same fake generate.

Both sides roll out pre-built prompt groups with the same fake `generate_group` (yields to the
loop, optionally sleeps to stand in for engine latency, marks samples done). The bare side runs
them in waves of `batch` groups with `asyncio.gather` (a synchronous rollout); the producer side
drains `batch` groups at a time through the worker, buffer and filters. The producer runs ahead of
the trainer by design (up to in-flight + buffer groups), so time is divided by the groups each
side actually generated. Rounds alternate in one process; figures are medians.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

from trainer_integration.producer import FullyAsyncProducer, ProducerConfig
from trainer_integration.rollout_buffer import Group, Sample, SampleStatus


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    n: int
    batches: int
    latency_s: float
    granularity: str = "sample"


CASES = [
    Case("no latency, sample backfill", batch=32, n=8, batches=40, latency_s=0.0),
    Case("no latency, group granularity", batch=32, n=8, batches=40, latency_s=0.0, granularity="group"),
    Case("2 ms per group, sample backfill", batch=32, n=8, batches=10, latency_s=0.002),
    Case("20 ms per group, sample backfill", batch=32, n=8, batches=10, latency_s=0.020),
]
ROUNDS = 5


def make_groups(case: Case) -> list[Group]:
    # enough for the drained batches plus what the producer may run ahead (in flight + buffer)
    total = case.batch * (case.batches + 4)
    return [[Sample(index=g * case.n + i, prompt=f"p{g}", group_index=g) for i in range(case.n)] for g in range(total)]


def make_generate(latency_s: float, calls: list[int]):
    async def generate(group: Group, sample_done) -> Group:
        calls[0] += 1
        if latency_s:
            await asyncio.sleep(latency_s)
        else:
            await asyncio.sleep(0)
        for sample in group:
            sample.status = SampleStatus.COMPLETED
            sample.weight_version = 1
            if sample_done is not None:
                sample_done()
        return group

    return generate


class PoolSource:
    def __init__(self, groups: list[Group]) -> None:
        self._groups = iter(groups)

    def get_group(self) -> Group:
        return next(self._groups)  # the pool is sized so that it never runs out

    def recycle(self, group: Group) -> None:
        raise AssertionError("nothing is aborted in this benchmark")


async def run_bare(case: Case, groups: list[Group]) -> tuple[float, int]:
    calls = [0]
    generate = make_generate(case.latency_s, calls)
    t0 = time.perf_counter()
    for start in range(0, case.batch * case.batches, case.batch):
        done = await asyncio.gather(*(generate(g, None) for g in groups[start : start + case.batch]))
        assert len(done) == case.batch
    return time.perf_counter() - t0, calls[0]


async def run_producer(case: Case, groups: list[Group]) -> tuple[float, int]:
    config = ProducerConfig(
        rollout_batch_size=case.batch, n_samples_per_prompt=case.n, submission_granularity=case.granularity
    )
    calls = [0]
    producer = FullyAsyncProducer(config, make_generate(case.latency_s, calls), PoolSource(groups))
    t0 = time.perf_counter()
    for _ in range(case.batches):
        batch = await producer.get_batch()
        assert len(batch.groups) == case.batch
    elapsed, generated = time.perf_counter() - t0, calls[0]
    await producer.close()
    return elapsed, generated


def measure(case: Case) -> tuple[float, float]:
    """Median µs per generated group: (bare, producer)."""
    bare, prod = [], []
    for _ in range(ROUNDS):
        seconds, generated = asyncio.run(run_bare(case, make_groups(case)))
        bare.append(1e6 * seconds / generated)
        seconds, generated = asyncio.run(run_producer(case, make_groups(case)))
        prod.append(1e6 * seconds / generated)
    return statistics.median(bare), statistics.median(prod)


def main() -> None:
    print("| case | drained groups | µs/group bare gather | µs/group producer | overhead µs/group | ratio |")
    print("|---|---|---|---|---|---|")
    for case in CASES:
        bare, prod = measure(case)
        print(
            f"| {case.name} (batch {case.batch}, n {case.n}) | {case.batch * case.batches} | {bare:.1f} | "
            f"{prod:.1f} | {prod - bare:.1f} | {prod / bare:.2f} |"
        )


if __name__ == "__main__":
    main()
