"""`pinned-eval best RUN --metric eval/<ds>`: the run's best measured step by a dataset's score.

Reads the run's history as `pinned-eval status` does (flow run states, scores from the JSONL
sink): only points whose newest flow run measured count; ties go to the earliest step. Prints
`step <N>: <metric>=<value> (weight version <V>)`, or the point as JSON with `--json`.

Cost: with a JSONL ledger (the sinks block the run's newest point names), the steps are ranked
from the ledger and only the best `BATCH` candidates' flow runs are read (one request; the next
`BATCH` only when none of them still stands measured), whatever the run's history. Without a
ledger the scores live in per-point artifacts, and the whole history is read (`read_history`).

Exit codes: 0 found; 1 no measured point has the metric (or Prefect unreachable); 2 bad input
(`--metric` not of the form `eval/<dataset>`, no API URL).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from app.commands.points import fail, prefect_client

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

    from app.history import PointHistory

_METRIC = re.compile(r"^eval/(?P<ds>[A-Za-z0-9][A-Za-z0-9_.\-]{0,63})$")


def best(
    run: Annotated[str, typer.Argument(help="Training run name, e.g. exp42.")],
    metric: Annotated[str, typer.Option("--metric", help="A dataset's score, eval/<dataset>.")],
    lowest: Annotated[bool, typer.Option("--min", help="Lowest value is best (a loss-like metric).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the best point as JSON.")] = False,
) -> None:
    """The best measured step of RUN by METRIC (the checkpoint to keep or resume from)."""
    from app.history import read_history  # prefect: slow import; `pinned-eval --help` stays fast

    match = _METRIC.fullmatch(metric)
    if match is None:
        fail(f"--metric: {metric!r} must be eval/<dataset>", 2)
    dataset = match["ds"]
    sign = -1.0 if lowest else 1.0
    with prefect_client() as client:
        found = best_from_ledger(client, run, dataset, sign)
        if found is None:  # no ledger: the scores are in the per-point artifacts
            history = read_history(run, client=client)
            scored = [(p.scores[dataset], p) for p in history.points
                      if p.outcome == "measured" and dataset in p.scores]
            ranked = sorted(scored, key=lambda vp: (-sign * vp[0], vp[1].step))
            found = ranked[0] if ranked else False
    if not isinstance(found, tuple):
        fail(f"no measured point of run {run!r} has {metric}")
    value, point = found
    if as_json:
        typer.echo(json.dumps({"run": run, "step": point.step, "metric": metric, "value": value,
                               "weight_version": point.weight_version, "flow_run_id": point.flow_run_id}))
        return
    typer.echo(f"step {point.step}: {metric}={value:.4f} (weight version {point.weight_version or '-'})")


BATCH = 20


def best_from_ledger(
    client: SyncPrefectClient, run: str, dataset: str, sign: float
) -> tuple[float, PointHistory] | Literal[False] | None:
    """(value, point) of the best measured step ranked from the run's JSONL ledger, its state
    confirmed by its flow runs (`read_history(steps=...)`, `BATCH` candidates a request); False
    when no step measured it; None when the run's newest point names a sinks block without a
    ledger (or the run has no point), so only the artifacts hold the scores."""
    from app.history import _jsonl_path, newest_point_sinks, read_history
    from pinned_eval.sinks import Ledger

    sinks = newest_point_sinks(client, run)
    path = _jsonl_path(sinks) if sinks is not None else None
    if path is None:
        return None
    metric = f"eval/{dataset}"
    scores = {r.step: r.metrics[metric] for r in Ledger(path).read(run)
              if r.state == "measured" and r.dataset == dataset and metric in r.metrics}
    ranked = sorted(scores, key=lambda step: (-sign * scores[step], step))
    for i in range(0, len(ranked), BATCH):
        batch = ranked[i : i + BATCH]
        history = read_history(run, client=client, steps=batch)
        for step in batch:  # in rank order: the first that still stands measured
            p = history.point(step)
            if p is not None and p.outcome == "measured" and dataset in p.scores:
                return p.scores[dataset], p
    return False
