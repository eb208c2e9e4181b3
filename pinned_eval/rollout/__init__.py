"""Rollouts: how one sample of an eval dataset gets produced, against one point's session.

Posture (how weights reach the engines: pin, verify, external) and rollout kind (how a sample is
produced: single turn; later a user generate function, a sandboxed harness) are separate axes:
a rollout kind sees only the point's `PointSession` (`pinned_eval.rollout.session`), so the
version check, abort retries, the concurrency bound and accounting exist once, for every kind.

Contract:
- `Rollout`: a kind with a `name` and `open(session, datasets, rows)`, an async context that
  prepares the kind for those datasets (single turn: renders every prompt) and yields `produce`,
  `async (dataset, row, j) -> Sample | list[Sample]` (a list: a miles generate function that
  returned several samples, each an eval sample as in miles); whatever it started ends when the context exits. Every
  model call goes through `session.generate`;
- `ROLLOUTS`: the registry, by name; `register_rollout` adds one explicitly, and a name
  registered twice raises `ValueError`. `single_turn`, `function` and `lm_eval`
  (`pinned_eval.rollout.lm_eval`: lm-eval tasks) are registered here;
- `rollout_kind(ds)`: the kind a dataset uses, `ds.rollout`: `lm_eval` for `kind: lm_eval`,
  `function` when it names a miles generate function (`pinned_eval.rollout.function`), else
  `single_turn`;
- `run_rollouts(session, datasets, rows, on_start=, on_sample=)`: the one loop. It groups the
  datasets by kind and opens each kind once (all of them before the first request), then runs
  every (dataset, row, j), j < `n_samples_per_prompt`, concurrently (the session bounds requests
  in flight) and returns the samples in that order (dataset, row, j), a list flattened in
  place. `on_start(total)` is called once every kind is open, `on_sample(sample)` as each sample
  ends. A failing sample fails the call (the caller maps errors to skips: `pinned_eval.skip_mapping.fleet_skips`).
This package imports no Prefect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Protocol

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.rollout.function import FunctionRollout
from pinned_eval.rollout.lm_eval import LmEvalRollout
from pinned_eval.rollout.session import PointSession, SessionCounters
from pinned_eval.rollout.single_turn import SingleTurn
from pinned_eval.rollout.types import Produce, Sample, Usage

__all__ = [
    "ROLLOUTS",
    "PointSession",
    "Produce",
    "Rollout",
    "Sample",
    "SessionCounters",
    "Usage",
    "register_rollout",
    "rollout_kind",
    "run_rollouts",
]


class Rollout(Protocol):
    """A rollout kind (see the package docstring)."""

    name: str

    def open(
        self,
        session: PointSession,
        datasets: Sequence[ResolvedDataset],
        rows: Mapping[str, Sequence[EvalSample]],
    ) -> AbstractAsyncContextManager[Produce]: ...


ROLLOUTS: dict[str, Rollout] = {}


def register_rollout(rollout: Rollout) -> Rollout:
    """Add `rollout` to `ROLLOUTS` under its name; a name already there raises `ValueError`."""
    if rollout.name in ROLLOUTS:
        raise ValueError(f"rollout {rollout.name!r}: already registered ({type(ROLLOUTS[rollout.name]).__name__})")
    ROLLOUTS[rollout.name] = rollout
    return rollout


register_rollout(SingleTurn())
register_rollout(FunctionRollout())
register_rollout(LmEvalRollout())


def rollout_kind(ds: ResolvedDataset) -> str:
    """The registered kind that produces `ds`'s samples: `ds.rollout` (`function` when the dataset
    names a generate function, else `single_turn`)."""
    return ds.rollout


async def run_rollouts(
    session: PointSession,
    datasets: Sequence[ResolvedDataset],
    rows: Mapping[str, Sequence[EvalSample]],
    *,
    on_start: Callable[[int], None] | None = None,
    on_sample: Callable[[Sample], None] | None = None,
) -> list[Sample]:
    """Every sample of `datasets`, in (dataset, row, j) order (see the package docstring)."""
    by_kind: dict[str, list[ResolvedDataset]] = {}
    for ds in datasets:
        by_kind.setdefault(rollout_kind(ds), []).append(ds)
    work = [(ds, s, j) for ds in datasets for s in rows[ds.name] for j in range(ds.n_samples_per_prompt)]
    async with AsyncExitStack() as stack:
        produce: dict[str, Produce] = {}
        for kind, group in by_kind.items():
            produce[kind] = await stack.enter_async_context(ROLLOUTS[kind].open(session, group, rows))
        if on_start is not None:
            on_start(len(work))

        async def one(ds: ResolvedDataset, s: EvalSample, j: int) -> list[Sample]:
            out = await produce[rollout_kind(ds)](ds, s, j)
            samples = out if isinstance(out, list) else [out]
            if on_sample is not None:
                for sample in samples:
                    on_sample(sample)
            return samples

        return [x for group in await asyncio.gather(*(one(ds, s, j) for ds, s, j in work)) for x in group]
