"""The regression rule of a suite block: when a measured dataset counts as regressed (docs/alerts.md).

A dataset of the point at step s regressed when, against a baseline taken from the run's earlier
measured points of that dataset (steps < s, JSONL rows):
- `baseline="best"`: the highest value of `metric` so far; `"previous"`: the value at the
  nearest earlier measured step;
- the drop `baseline - value` is larger than `threshold` (absolute, in the metric's units), and
- with `outside_interval` (default), the baseline lies above this point's bootstrap interval
  (`ci95_high < baseline`): a drop the point's own uncertainty explains is no regression.
No earlier point, or a metric missing from a row, is no baseline: nothing regresses.
`metric` names the key with `{ds}` for the dataset (`eval/{ds}`, `eval/{ds}-pass@4`); the
interval is that of `eval/{ds}` (the mean), used only when `metric` is `eval/{ds}`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Regression(BaseModel):
    """One dataset that regressed: what `pinned-eval.point.regressed` carries."""

    model_config = ConfigDict(frozen=True)

    dataset: str
    metric: str
    value: float
    baseline: float
    baseline_step: int
    drop: float
    ci95_high: float | None = None


class RegressionRule(BaseModel):
    """Drop beyond `threshold` versus the best or the previous point, outside the interval."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: str = Field(default="eval/{ds}", pattern=r"^eval/\{ds\}[A-Za-z0-9_@^./\-]*$",
                        description="Metric key with {ds} for the dataset name.")
    baseline: Literal["best", "previous"] = Field(
        default="best", description="Compare with the best or the previous point."
    )
    threshold: float = Field(default=0.0, ge=0, description="A drop must exceed this (absolute) to count.")
    outside_interval: bool = Field(
        default=True, description="Also require the baseline above this point's ci95_high (metric eval/{ds} only)."
    )

    def check(
        self, dataset: str, step: int, current: Mapping[str, float], history: Iterable[tuple[int, Mapping[str, float]]]
    ) -> Regression | None:
        """`current`: this point's metrics of `dataset`; `history`: (step, metrics) of its earlier
        measured rows (any order; steps >= `step` are ignored)."""
        key = self.metric.format(ds=dataset)
        if key not in current:
            return None
        earlier = sorted((s, m[key]) for s, m in history if s < step and key in m)
        if not earlier:
            return None
        if self.baseline == "previous":
            base_step, base = earlier[-1]
        else:
            base_step, base = max(earlier, key=lambda sv: (sv[1], -sv[0]))  # best; ties: earliest step
        value = current[key]
        drop = base - value
        if drop <= self.threshold:
            return None
        high = current.get(f"eval/{dataset}/ci95_high") if key == f"eval/{dataset}" else None
        if self.outside_interval and high is not None and high >= base:
            return None
        return Regression(dataset=dataset, metric=key, value=value, baseline=base, baseline_step=base_step,
                          drop=drop, ci95_high=high)
