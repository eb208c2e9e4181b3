"""Score task: rewards per sample and the DESIGN §6 metrics per dataset.

Contract: a reward function that raises propagates (the point crashes: `skipped_crashed`,
Failed run); a reward returning None counts in `-none_reward_ratio`. Rewards get the row's
metadata; `remote_rm` posts to the suite's scoring service, and a service that gives no reward
after its retries (`RemoteRewardError`) skips the point as `reward_unavailable` — never a 0
score. The per-sample artifact is a sink (`tasks.log.attempt_sink`): retried, and if it still
fails the point stays measured with `eval/sink_failed_samples: 1` and a WARNING; the samples file
(a results store configured) likewise, with `eval/sink_failed_results: 1`.
Weight-version metrics are computed against the pinned version, so `weight_version/mean == step`
and `mixed_version_ratio == 0` prove the pin.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pinned_eval.external import DatasetResult
from pinned_eval.results.store import ResultsStore
from pinned_eval.scoring.metrics import LENGTH_FINISH_REASON, ScoredSample, dataset_metrics
from pinned_eval.scoring.remote import RewardItem, score_responses
from pinned_eval.skip_mapping import fleet_skips
from pinned_eval.suite import EvalSuite, ResolvedDataset
from tasks.external import record_point_samples
from tasks.generate import Generation
from tasks.log import SINK_ATTEMPTS, SINK_FAILED, attempt_sink
from tasks.results import write_samples

Rewards = dict[tuple[str, int, int], float | None]  # (dataset, example id, sample index) -> reward


def score_generations(
    generations: list[Generation], datasets: list[ResolvedDataset], suite: EvalSuite, step: int
) -> tuple[dict[str, dict[str, float]], dict[str, DatasetResult], Rewards]:
    """Metrics per dataset, per-sample results per dataset and every sample's reward (no Prefect
    run needed: `pinned-eval rescore` calls it on stored generations)."""
    weight_version = str(step)
    by_ds: dict[str, list[Generation]] = defaultdict(list)
    for g in generations:
        by_ds[g.dataset].append(g)
    out, samples, by_sample = {}, {}, {}
    for ds in datasets:
        gens = by_ds[ds.name]
        items = [RewardItem(g.prompt, g.response, g.label, g.metadata) for g in gens]
        with fleet_skips(f"dataset {ds.name!r}"):  # a scoring service that gives no reward → reward_unavailable
            rewards = asyncio.run(score_responses(ds.reward, items, suite.remote_reward, suite.miles_args(ds)))
        scored = [
            ScoredSample(
                prompt_index=g.prompt_index,
                sample_index=g.sample_index,
                response=g.response,
                response_len=g.response_len,
                reward=reward,
                truncated=g.finish_reason == LENGTH_FINISH_REASON,
                weight_version=g.weight_version,
            )
            for g, reward in zip(gens, rewards, strict=True)
        ]
        by_sample.update({(g.dataset, g.prompt_index, g.sample_index): r for g, r in zip(gens, rewards, strict=True)})
        samples[ds.name] = DatasetResult.from_scored(scored)
        out[ds.name] = dataset_metrics(
            ds.name,
            scored,
            pass_at_k=suite.pass_at_k and ds.n_samples_per_prompt > 1,
            pass_threshold=suite.pass_threshold,
            expected_version=weight_version,
        )
    return out, samples, by_sample


@task(cache_policy=NO_CACHE, task_run_name="score")
def score(
    generations: list[Generation],
    datasets: list[ResolvedDataset],
    suite: EvalSuite,
    run: str,
    step: int,
    results: ResultsStore | None = None,
    generation_key: str | None = None,
) -> dict[str, dict[str, float]]:
    """Metrics per dataset name, each a dict of `eval/<ds>...` keys; per-sample results are
    published as the point's samples artifact (what the miles adapter reads back) and, with a
    results store, written with their texts as the point's samples file (`tasks.results`)."""
    out, samples, rewards = score_generations(generations, datasets, suite, step)
    failed = []
    error = attempt_sink(lambda: record_point_samples(run, step, samples))
    if error:
        get_run_logger().warning("sink samples failed for %s/step-%d after %d attempts; the point keeps its "
                                 "outcome: %s", run, step, SINK_ATTEMPTS, error)  # fmt: skip
        failed.append("samples")
    if results is not None:
        store = results

        def write() -> None:
            write_samples(store, run, step, generations, rewards, generation_key)

        error = attempt_sink(write)
        if error:
            get_run_logger().warning("sink results failed for %s/step-%d after %d attempts; the point keeps its "
                                     "outcome: %s", run, step, SINK_ATTEMPTS, error)  # fmt: skip
            failed.append("results")
    flags = {f"{SINK_FAILED}{sink}": 1.0 for sink in failed}
    return {ds: {**metrics, **flags} for ds, metrics in out.items()}
