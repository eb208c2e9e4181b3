"""Eval metrics with miles' names (docs/metrics.md): per dataset, per point, and for skipped points.

Per dataset `ds` (`dataset_metrics`), following miles `log_eval_rollout_data`:
- `eval/{ds}-none_reward_ratio`: fraction of samples whose reward is None; those rewards then
  count as 0.0 in `eval/{ds}` (miles' rule).
- `eval/{ds}`: mean reward (0.0 for no samples); `eval/{ds}-truncated_ratio`: fraction of samples
  that stopped on the length limit (SGLang finish_reason "length").
- `eval/{ds}-pass@k` for k = 1, 2, 4, … ≤ n, only when pass@k is on and n > 1; unbiased
  estimator averaged over prompts; success = reward >= `pass_threshold` (1.0: miles' "reward
  exactly 1" for binary rewards). Every prompt must have exactly n samples.
- `eval/{ds}/stderr`, `eval/{ds}/ci95_low`, `eval/{ds}/ci95_high` (`statistics`, on by default):
  standard error and seeded bootstrap 95% interval of the mean over prompts
  (`pinned_eval.scoring.stats`); the interval with at least one prompt, stderr with at least two.
- with pass@k on and n > 1, beside pass@k: `eval/{ds}/avg@{n}` (mean reward of the n samples,
  averaged over prompts), `eval/{ds}-pass^{k}` (all k correct, C(c,k)/C(n,k)) and
  `eval/{ds}-maj@{k}` (majority vote of the first k samples is correct), k = 1, 2, 4, … ≤ n.
- `eval/{ds}/response_len/{mean,max,min}` (tokens), when there are samples.
- `eval/{ds}/weight_version/{mean,min,max}` over the samples' numeric versions and
  `eval/{ds}/weight_version/mixed_version_ratio`, only when some version is numeric (miles' rule).
  miles counts a sample as mixed when its own list of versions has more than one value (weights
  changed mid-generation). Here one engine generates a whole response, so a sample carries one
  version and the possible mix is across samples: a sample counts as mixed when its version
  differs from `expected_version` (the pinned one) or, without it, from the most common version;
  a sample with no version counts as mixed (it cannot prove the pin). So a point proves its pin
  when `weight_version/mean == eval/step` and `mixed_version_ratio == 0`.
Per point: `eval/step`, `eval/lag_steps`, `eval/duration_seconds`, `eval/export_time_seconds`
(when exported). Skipped point: `eval/step` and `eval/skipped_<reason>: 1`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pinned_eval.scoring.answers import Label
from pinned_eval.scoring.passk import mean_pass_at_k, pass_at_k_values
from pinned_eval.scoring.rewards import RewardFn
from pinned_eval.scoring.stats import bootstrap_ci, majority_at_k, pass_hat_k, stderr, vote_key
from pinned_eval.skips import SkipReason, skip_metric

LENGTH_FINISH_REASON = "length"


@dataclass(frozen=True, slots=True)
class ScoredSample:
    """One generated response with its reward; `sample_index` is the replica j of prompt p."""

    prompt_index: int
    sample_index: int
    response: str
    response_len: int
    reward: float | None
    truncated: bool
    weight_version: str | None

    @classmethod
    def score(
        cls,
        reward_fn: RewardFn,
        *,
        prompt_index: int,
        sample_index: int,
        response: str,
        label: Label,
        response_len: int,
        finish_reason: str | None,
        weight_version: str | None,
    ) -> ScoredSample:
        """Apply `reward_fn` (its exceptions propagate) and build the sample; `finish_reason` is
        SGLang's `meta_info.finish_reason.type` ("length" means truncated)."""
        return cls(
            prompt_index=prompt_index,
            sample_index=sample_index,
            response=response,
            response_len=response_len,
            reward=reward_fn(response, label),
            truncated=finish_reason == LENGTH_FINISH_REASON,
            weight_version=weight_version,
        )


def dataset_metrics(
    ds_name: str,
    samples: Sequence[ScoredSample],
    *,
    pass_at_k: bool = False,
    pass_threshold: float = 1.0,
    expected_version: str | None = None,
    statistics: bool = True,
) -> dict[str, float]:
    """The metrics of one dataset at one point (see the module docstring for each rule)."""
    key = f"eval/{ds_name}"
    total = len(samples)
    rewards = [s.reward for s in samples]
    out: dict[str, float] = {
        f"{key}-none_reward_ratio": _ratio(sum(r is None for r in rewards), total),
        key: _ratio(sum(r or 0.0 for r in rewards), total),
        f"{key}-truncated_ratio": _ratio(sum(s.truncated for s in samples), total),
    }
    if not samples:
        return out
    groups = _groups(samples)
    if statistics:
        out.update(_spread(key, groups))
    if pass_at_k:
        out.update(_pass_at_k(key, groups, pass_threshold))
    lens = [s.response_len for s in samples]
    out[f"{key}/response_len/mean"] = sum(lens) / total
    out[f"{key}/response_len/max"] = float(max(lens))
    out[f"{key}/response_len/min"] = float(min(lens))
    out.update(_weight_version(key, samples, expected_version))
    return out


def _ratio(part: float, total: int) -> float:
    return part / total if total else 0.0


def _groups(samples: Sequence[ScoredSample]) -> dict[int, list[ScoredSample]]:
    groups: dict[int, list[ScoredSample]] = {}
    seen: set[tuple[int, int]] = set()
    for s in samples:
        ident = (s.prompt_index, s.sample_index)
        if ident in seen:
            raise ValueError(
                f"duplicate sample: prompt_index={s.prompt_index}, sample_index={s.sample_index}"
            )
        seen.add(ident)
        groups.setdefault(s.prompt_index, []).append(s)
    return groups


def _pass_at_k(key: str, groups: dict[int, list[ScoredSample]], threshold: float) -> dict[str, float]:
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1:
        raise ValueError(
            f"{key}: pass@k needs the same number of samples per prompt, got sizes {sorted(sizes)}"
        )
    n = sizes.pop()
    if n < 2:
        return {}
    ok = [[s.reward is not None and s.reward >= threshold for s in sorted(g, key=_replica)] for g in groups.values()]
    correct = [sum(g) for g in ok]
    ks = pass_at_k_values(n)
    out = {f"{key}-pass@{k}": mean_pass_at_k(correct, n, k) for k in ks}
    out[f"{key}/avg@{n}"] = sum(_prompt_means(groups)) / len(groups)
    out.update({f"{key}-pass^{k}": sum(pass_hat_k(n, c, k) for c in correct) / len(correct) for k in ks})
    votes = [[vote_key(s.response) for s in sorted(g, key=_replica)] for g in groups.values()]
    for k in ks:
        out[f"{key}-maj@{k}"] = sum(majority_at_k(v, o, k) for v, o in zip(votes, ok, strict=True)) / len(ok)
    return out


def _replica(s: ScoredSample) -> int:
    return s.sample_index


def _prompt_means(groups: dict[int, list[ScoredSample]]) -> list[float]:
    return [sum(s.reward or 0.0 for s in g) / len(g) for _, g in sorted(groups.items())]


def _spread(key: str, groups: dict[int, list[ScoredSample]]) -> dict[str, float]:
    means = _prompt_means(groups)
    low, high = bootstrap_ci(means)
    out = {f"{key}/ci95_low": low, f"{key}/ci95_high": high}
    if len(means) >= 2:
        out[f"{key}/stderr"] = stderr(means)
    return out


def _numeric(version: str | None) -> float | None:
    if version is None:
        return None
    try:
        return float(int(version))
    except ValueError:
        try:
            return float(version)
        except ValueError:
            return None


def _weight_version(key: str, samples: Sequence[ScoredSample], expected: str | None) -> dict[str, float]:
    numeric = [v for v in (_numeric(s.weight_version) for s in samples) if v is not None]
    if not numeric:
        return {}
    if expected is None:
        counts = Counter(s.weight_version for s in samples if s.weight_version is not None)
        # most common; ties go to the newest (largest numeric) version, for determinism
        expected = max(counts, key=lambda v: (counts[v], _numeric(v) or 0.0, v))
    mixed = sum(s.weight_version is None or s.weight_version != expected for s in samples)
    return {
        f"{key}/weight_version/mean": sum(numeric) / len(numeric),
        f"{key}/weight_version/min": min(numeric),
        f"{key}/weight_version/max": max(numeric),
        f"{key}/weight_version/mixed_version_ratio": mixed / len(samples),
    }


def point_metrics(
    step: int, lag_steps: int, duration_seconds: float, export_time_seconds: float | None = None
) -> dict[str, float]:
    """Per-point metrics logged with the datasets' (export time only when this point exported)."""
    if lag_steps < 0 or duration_seconds < 0 or (export_time_seconds is not None and export_time_seconds < 0):
        raise ValueError(
            f"point metrics must be non-negative: lag_steps={lag_steps}, "
            f"duration_seconds={duration_seconds}, export_time_seconds={export_time_seconds}"
        )
    out: dict[str, float] = {
        "eval/step": step,
        "eval/lag_steps": lag_steps,
        "eval/duration_seconds": duration_seconds,
    }
    if export_time_seconds is not None:
        out["eval/export_time_seconds"] = export_time_seconds
    return out


def skip_metrics(step: int, reason: str | SkipReason) -> dict[str, float]:
    """What a skipped point logs: `eval/skipped_<reason>: 1` at its `eval/step`."""
    return {"eval/step": step, skip_metric(reason): 1}
