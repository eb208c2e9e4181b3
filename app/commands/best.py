"""`pinned-eval best RUN --metric eval/<ds>`: the run's best measured step by a dataset's score.

Reads the run's history as `pinned-eval status` does (flow run states, scores from the JSONL
sink): only points whose newest flow run measured count; ties go to the earliest step. Prints
`step <N>: <metric>=<value> (weight version <V>)`, or the point as JSON with `--json`.

Exit codes: 0 found; 1 no measured point has the metric (or Prefect unreachable); 2 bad input
(`--metric` not of the form `eval/<dataset>`, no API URL).
"""

from __future__ import annotations

import json
import re
from typing import Annotated

import typer

from app.commands.points import fail, prefect_client

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
    with prefect_client() as client:
        history = read_history(run, client=client)
    scored = [(p.scores[dataset], p) for p in history.points if p.outcome == "measured" and dataset in p.scores]
    if not scored:
        fail(f"no measured point of run {run!r} has {metric}")
    sign = -1.0 if lowest else 1.0
    value, point = max(scored, key=lambda vp: (sign * vp[0], -vp[1].step))
    if as_json:
        typer.echo(json.dumps({"run": run, "step": point.step, "metric": metric, "value": value,
                               "weight_version": point.weight_version, "flow_run_id": point.flow_run_id}))
        return
    typer.echo(f"step {point.step}: {metric}={value:.4f} (weight version {point.weight_version or '-'})")
