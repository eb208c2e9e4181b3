"""Generate task: every dataset of the suite, concurrently, through the pinned fleet's router.

A Prefect shell around `pinned_eval.rollout`: it builds the point's `PointSession` on the fleet's
router client and runs `run_rollouts` (each dataset's rollout kind; today `single_turn`).
Contract: prompts are rendered by `pinned_eval.prompts.PromptRenderer` with the tokenizer of the
pinned checkpoint (`tokenizer_dir`), all before the first request (a bad template or message-list
prompt fails the point with a `PromptError` naming the dataset, before any generation). One
request per (prompt, sample) with a deterministic `sampling_seed` and `rid`
(`<rid_prefix>-<dataset>-<prompt>-<j>`); the fleet client bounds requests in flight (the
fleet's request concurrency), retries `abort` finishes and refuses any response whose
`weight_version` is not the pinned one. Failures map to
skips: a response from other weights → `pin_violation`; a fleet that stops serving (transport
errors, 5xx, persistent aborts) → `unhealthy`; a request the engine rejects as malformed (4xx)
is a bug and propagates (the point crashes). Progress is a Prefect progress artifact, best
effort: when the artifacts API fails, a WARNING is logged and progress stops (the point goes on).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from blocks.fleet import FleetBlock
from pinned_eval.datasets.loader import EvalSample, load_dataset
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.rollout import PointSession, Sample, run_rollouts
from pinned_eval.skip_mapping import fleet_skips

Generation = Sample  # moved to pinned_eval.rollout.types.Sample; this name stays for one release


class _Progress:
    """Updates the progress artifact at most every 5 %; the first API failure stops it (logged)."""

    def __init__(self, total: int, key_hint: str) -> None:
        self.total, self.done, self._shown = max(total, 1), 0, 0.0
        self.artifact_id: UUID | None = None
        self._best_effort(lambda: self._create(f"generating {key_hint}"))

    def _create(self, description: str) -> None:
        self.artifact_id = cast(UUID, create_progress_artifact(0.0, description=description))

    def _best_effort(self, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as exc:  # a UI nicety: never fails the point; logged, then progress stops
            self.artifact_id = None
            get_run_logger().warning("progress artifact failed, progress no longer shown: %s: %s",
                                     type(exc).__name__, exc)

    def tick(self) -> None:
        self.done += 1
        pct = min(100.0, 100.0 * self.done / self.total)  # a work item may yield several samples (lm-eval)
        if self.artifact_id is not None and (pct - self._shown >= 5.0 or self.done == self.total):
            self._shown = pct
            artifact_id = self.artifact_id
            self._best_effort(lambda: update_progress_artifact(artifact_id, pct))


async def _generate_all(
    fleet: FleetBlock,
    datasets: list[ResolvedDataset],
    rows: dict[str, list[EvalSample]],
    version: str,
    rid_prefix: str,
    tokenizer_dir: str | None,
    lora: str | None,
) -> list[Sample]:
    progress: list[_Progress] = []  # created once every prompt has rendered (nothing shown for a bad one)
    async with fleet.client() as client:
        session = PointSession(
            client.generator, expected_version=version, rid_prefix=rid_prefix, lora=lora, tokenizer_dir=tokenizer_dir
        )
        return await run_rollouts(
            session,
            datasets,
            rows,
            on_start=lambda total: progress.append(_Progress(total, rid_prefix)),
            on_sample=lambda _: progress[0].tick(),
        )


@task(cache_policy=NO_CACHE, task_run_name="load-datasets")
def load_datasets(datasets: list[ResolvedDataset]) -> dict[str, list[EvalSample]]:
    """Every dataset's rows, validated (a bad row fails the point here, before any export)."""
    return {ds.name: load_dataset(ds) for ds in datasets}


@task(cache_policy=NO_CACHE, task_run_name="generate-{weight_version}")
def generate(
    fleet: FleetBlock,
    datasets: list[ResolvedDataset],
    rows: dict[str, list[EvalSample]],
    weight_version: str,
    rid_prefix: str,
    tokenizer_dir: str | None = None,
    lora_path: str | None = None,
) -> list[Sample]:
    """`tokenizer_dir`: the pinned checkpoint (fleet posture) or the engines' model (shared);
    only read when a dataset applies the chat template. `lora_path`: the adapter every request
    names (adapter mode: the weight version)."""
    with fleet_skips():  # pinned_eval.skip_mapping: other weights → pin_violation, a failing fleet → unhealthy
        return asyncio.run(
            _generate_all(fleet, datasets, rows, weight_version, rid_prefix, tokenizer_dir, lora_path)
        )
