"""Score task: rewards per sample and the metrics per dataset (docs/metrics.md).

Contract: a reward function that raises propagates (the point crashes: `skipped_crashed`,
Failed run); a reward returning None counts in `-none_reward_ratio`. Rewards get the row's
metadata; `remote_rm` posts to the suite's scoring service, and a service that gives no reward
after its retries (`RemoteRewardError`) skips the point as `reward_unavailable` — never a 0
score. Scoring writes nothing: it returns the metrics and the point's samples, which the log task
hands to the exporters (the samples artifact, the samples file) after the ledger.
An lm-eval dataset also gets lm-eval's own metrics and stderr per task, `eval/<task>/<metric>`
(`pinned_eval.rollout.lm_eval.lm_eval_metrics`). Weight-version metrics are computed against the
pinned version, so `weight_version/mean == step` and `mixed_version_ratio == 0` prove the pin.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from prefect import task
from prefect.cache_policies import NO_CACHE

from pinned_eval.external import DatasetResult
from pinned_eval.rollout.lm_eval import lm_eval_metrics
from pinned_eval.scoring.metrics import LENGTH_FINISH_REASON, ScoredSample, dataset_metrics
from pinned_eval.scoring.remote import RewardItem, score_responses
from pinned_eval.sinks import PointSamples
from pinned_eval.skip_mapping import fleet_skips
from pinned_eval.suite import EvalSuite, ResolvedDataset
from tasks.generate import Generation
from tasks.results import sample_rows

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
        rewards = _rewards(gens, ds, suite)
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
        if ds.kind == "lm_eval":  # lm-eval's own numbers and stderr, as it reported them
            out[ds.name].update(lm_eval_metrics(gens))
    return out, samples, by_sample


def _rewards(gens: list[Generation], ds: ResolvedDataset, suite: EvalSuite) -> list[float | None]:
    """miles' rule (generate_and_rm): a reward the rollout set (a generate function's) is kept; the
    dataset's reward scores the rest, except ABORTED samples, which get none."""
    rewards = [g.reward for g in gens]
    todo = [i for i, g in enumerate(gens) if g.reward is None and g.status != "aborted"]
    if not todo:
        return rewards
    items = [RewardItem(gens[i].prompt, gens[i].response, gens[i].label, gens[i].metadata) for i in todo]
    with fleet_skips(f"dataset {ds.name!r}"):  # a scoring service that gives no reward → reward_unavailable
        scored = asyncio.run(score_responses(ds.reward, items, suite.remote_reward, suite.miles_args(ds)))
    for i, reward in zip(todo, scored, strict=True):
        rewards[i] = reward
    return rewards


@task(cache_policy=NO_CACHE, task_run_name="score")
def score(
    generations: list[Generation],
    datasets: list[ResolvedDataset],
    suite: EvalSuite,
    step: int,
    generation_key: str | None = None,
) -> tuple[dict[str, dict[str, float]], PointSamples]:
    """Metrics per dataset name (each a dict of `eval/<ds>...` keys) and the point's samples: per
    dataset for the samples artifact (what the miles adapter reads back), and with their texts
    for the samples file (`generation_key`: the generation cache key they were made under)."""
    out, samples, rewards = score_generations(generations, datasets, suite, step)
    return out, PointSamples(results=samples, rows=sample_rows(generations, rewards), key=generation_key)
