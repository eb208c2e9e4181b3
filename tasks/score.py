"""Score task: rewards per sample and the DESIGN §6 metrics per dataset.

Contract: a reward function that raises propagates (the point crashes: `skipped_crashed`,
Failed run); a reward returning None counts in `-none_reward_ratio`. Weight-version metrics are
computed against the pinned version, so `weight_version/mean == step` and
`mixed_version_ratio == 0` prove the pin.
"""

from __future__ import annotations

from collections import defaultdict

from prefect import task
from prefect.cache_policies import NO_CACHE

from pinned_eval.external import DatasetResult
from pinned_eval.scoring.metrics import ScoredSample, dataset_metrics
from pinned_eval.scoring.rewards import get_reward
from pinned_eval.suite import EvalSuite, ResolvedDataset
from tasks.external import record_point_samples
from tasks.generate import Generation


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
        reward = get_reward(ds.reward)
        scored = [
            ScoredSample.score(
                reward,
                prompt_index=g.prompt_index,
                sample_index=g.sample_index,
                response=g.response,
                label=g.label,
                response_len=g.response_len,
                finish_reason=g.finish_reason,
                weight_version=g.weight_version,
            )
            for g in by_ds[ds.name]
        ]
        samples[ds.name] = DatasetResult.from_scored(scored)
        out[ds.name] = dataset_metrics(
            ds.name,
            scored,
            pass_at_k=suite.pass_at_k and ds.n_samples_per_prompt > 1,
            pass_threshold=suite.pass_threshold,
            expected_version=weight_version,
        )
    record_point_samples(run, step, samples)
    return out
