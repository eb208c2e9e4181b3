"""Score task: rewards per sample and the DESIGN §6 metrics per dataset.

Contract: a reward function that raises propagates (the point crashes: `skipped_crashed`,
Failed run); a reward returning None counts in `-none_reward_ratio`. Rewards get the row's
metadata; `remote_rm` posts to the suite's scoring service, and a service that gives no reward
after its retries (`RemoteRewardError`) skips the point as `reward_unavailable` — never a 0
score. The per-sample artifact is a sink (`tasks.log.attempt_sink`): retried, and if it still
fails the point stays measured with `eval/sink_failed_samples: 1` and a WARNING.
Weight-version metrics are computed against the pinned version, so `weight_version/mean == step`
and `mixed_version_ratio == 0` prove the pin.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pinned_eval.external import DatasetResult
from pinned_eval.scoring.metrics import LENGTH_FINISH_REASON, ScoredSample, dataset_metrics
from pinned_eval.scoring.remote import RewardItem, score_responses
from pinned_eval.skip_mapping import fleet_skips
from pinned_eval.suite import EvalSuite, ResolvedDataset
from tasks.external import record_point_samples
from tasks.generate import Generation
from tasks.log import SINK_ATTEMPTS, SINK_FAILED, attempt_sink


@task(cache_policy=NO_CACHE, task_run_name="score")
def score(
    generations: list[Generation], datasets: list[ResolvedDataset], suite: EvalSuite, run: str, step: int
) -> dict[str, dict[str, float]]:
    """Metrics per dataset name, each a dict of `eval/<ds>...` keys; per-sample results are
    published as the point's samples artifact (what the miles adapter reads back)."""
    weight_version = str(step)
    by_ds: dict[str, list[Generation]] = defaultdict(list)
    for g in generations:
        by_ds[g.dataset].append(g)
    out, samples = {}, {}
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
        samples[ds.name] = DatasetResult.from_scored(scored)
        out[ds.name] = dataset_metrics(
            ds.name,
            scored,
            pass_at_k=suite.pass_at_k and ds.n_samples_per_prompt > 1,
            pass_threshold=suite.pass_threshold,
            expected_version=weight_version,
        )
    error = attempt_sink(lambda: record_point_samples(run, step, samples))
    if error:
        get_run_logger().warning("sink samples failed for %s/step-%d after %d attempts; the point keeps its "
                                 "outcome: %s", run, step, SINK_ATTEMPTS, error)  # fmt: skip
        out = {ds: {**metrics, f"{SINK_FAILED}samples": 1.0} for ds, metrics in out.items()}
    return out
