"""Best-K retention: which measured steps of a run are its best K by a metric (no Prefect).

`best_steps` reads metric rows (the ledger's, `pinned_eval.sinks.MetricRow`): only rows of
`run` with state `measured` that carry `metrics[metric]` count (a skipped or failed rerun of a
step replaces its rows, so that step no longer counts). Ranked by value (`max`: highest first,
`min`: lowest first), ties to the earliest step; the first `k` steps are returned. The staging
keep-ring keeps their snapshots (`Staging.retire(..., protect=...)`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pinned_eval.sinks import MetricRow

KeepBestMode = Literal["max", "min"]


def best_steps(rows: Iterable[MetricRow], run: str, metric: str, k: int, mode: KeepBestMode = "max") -> frozenset[int]:
    """The (at most) `k` steps of `run` with the best `metric` among its measured rows."""
    values: dict[int, float] = {}
    for row in rows:
        if row.run == run and row.state == "measured" and metric in row.metrics:
            values.setdefault(row.step, row.metrics[metric])
    sign = 1.0 if mode == "max" else -1.0
    ranked = sorted(values, key=lambda step: (-sign * values[step], step))
    return frozenset(ranked[:k])
