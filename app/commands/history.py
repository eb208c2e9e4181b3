"""`pinned-eval status|report|janitor|prune`: read a run's eval history, plot it, clean up after lost
hosts, delete old flow runs by policy (`app.prune`).

Exit codes: 0 success; 1 the operation failed (no eval point of the run, Prefect unreachable,
the janitor flow failed); 2 bad input (unknown report format, bad option value, no API URL).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from app.commands.points import RunOpt, fail, prefect_client
from app.commands.results import last_two_compared

if TYPE_CHECKING:
    from app.history import RunHistory

DEFAULT_LAST = 50
LastOpt = Annotated[
    int | None,
    typer.Option("--last", min=0, metavar="N", help=f"Only the latest N steps (default {DEFAULT_LAST}, or every "
                 "step from --since; 0: every step)."),
]
SinceOpt = Annotated[int | None, typer.Option("--since", min=0, help="Only steps at or after STEP.", metavar="STEP")]


def window(last: int | None, since: int | None) -> int | None:
    """The `last` bound to read with: the default view is the latest `DEFAULT_LAST` steps; with
    `--since` alone, every step from there; `--last 0`, every step."""
    if last is None:
        return None if since is not None else DEFAULT_LAST
    return last or None


def status(
    run: RunOpt,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full history as JSON.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="List every attempt of every step.")] = False,
    last: LastOpt = None,
    since: SinceOpt = None,
) -> None:
    """Table of a run's steps: state, reason, score per dataset, weight version, lag, attempts; then
    the reason and message of every skipped or failed step."""
    from app.history import read_history  # prefect: slow import; `pinned-eval --help` stays fast
    from app.report import (  # prefect: slow import; `pinned-eval --help` stays fast
        attempts_lines,
        format_table,
        status_rows,
    )

    with prefect_client() as client:
        history = read_history(run, client=client, last=window(last, since), since=since)
    if as_json:
        doc = {**history.model_dump(mode="json"), "table": status_rows(history)}
        typer.echo(json.dumps(doc, indent=2))
    if not history.points:
        fail(f"no eval point of run {run!r} is recorded")
    if as_json:
        return
    typer.echo(format_table(history))
    for p in history.points:
        if verbose or len(p.attempts) > 1:
            typer.echo(f"step {p.step}:")
            for line in attempts_lines(p):
                typer.echo(line)
    for line in outcome_lines(history):
        typer.echo(line)


def outcome_lines(history: RunHistory) -> list[str]:
    """One line per step that did not measure and has ended (skipped, failed, crashed, cancelled):
    `step N: <outcome> <reason>: <state message>` — why, without `-v`."""
    lines = []
    for p in history.points:
        if p.outcome not in ("skipped", "failed", "crashed", "cancelled"):
            continue
        message = (p.message or "").removeprefix(f"{p.reason}:").strip() if p.reason else (p.message or "")
        lines.append(f"step {p.step}: {p.outcome} {p.reason or '-'}" + (f": {message}" if message else ""))
    return lines


def report(
    run: RunOpt,
    out: Annotated[Path, typer.Option("--out", help="FILE.png or FILE.html (PNG embedded + table).")],
    sinks: Annotated[
        str | None,
        typer.Option("--sinks", help="Sinks block with a results store: the HTML adds the flips between the "
                     "last two measured steps (`pinned-eval compare`)."),
    ] = None,
    last: LastOpt = None,
    since: SinceOpt = None,
) -> None:
    """Plot score per dataset vs step; skipped and failed steps are marked with their reason."""
    from app.history import read_history  # prefect: slow import; `pinned-eval --help` stays fast
    from app.report import write_report  # prefect: slow import; `pinned-eval --help` stays fast

    if out.suffix.lower() not in (".png", ".html", ".htm"):
        fail(f"--out: {out.name!r} must end in .png or .html", 2)
    with prefect_client() as client:
        history = read_history(run, client=client, last=window(last, since), since=since)
        if not history.points:
            fail(f"no eval point of run {run!r} is recorded")
        comparison = last_two_compared(history, sinks) if sinks else ""  # app/commands/results.py
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(history, out, comparison)
    typer.echo(f"wrote {out} ({len(history.points)} steps, datasets: {', '.join(history.datasets) or 'none'})")


def janitor(
    heartbeat_window: Annotated[
        float, typer.Option("--heartbeat-window", min=1, help="Seconds without activity before a point is stuck.")
    ] = 600.0,
    run: Annotated[str | None, typer.Option("--run", help="Only this training run.")] = None,
    orphan_age: Annotated[
        float, typer.Option("--orphan-age", min=0, help="Seconds before a snapshot with no flow run is retired.")
    ] = 86400.0,
    staging: Annotated[
        list[str] | None, typer.Option("--staging", help="Staging block to sweep (repeatable; default: default).")
    ] = None,
) -> None:
    """Crash stuck points (lost host), record skipped_crashed, retire orphaned staged snapshots."""
    with prefect_client():
        from flows.janitor import janitor as janitor_flow  # prefect: slow import; `pinned-eval --help` stays fast

        state = janitor_flow(
            heartbeat_window_s=heartbeat_window, run=run, orphan_age_s=orphan_age, staging=staging,
            return_state=True,
        )
    if not state.is_completed():
        fail(f"janitor flow ended {state.name}: {state.message}")
    result = state.result()
    for p in result.crashed:
        typer.echo(f"crashed {p.name} {p.flow_run_id} (quiet {p.quiet_seconds:.0f}s, was {p.state})")
    for path in result.retired:
        typer.echo(f"retired {path}")
    typer.echo(f"janitor: {len(result.crashed)} crashed, {len(result.retired)} retired, "
               f"{len(result.kept_live)} live snapshot(s) kept")


def prune(
    run: RunOpt,
    keep_last: Annotated[
        int, typer.Option("--keep-last", min=1, metavar="N", help="Keep every flow run of the latest N steps.")
    ],
    yes: Annotated[bool, typer.Option("--yes", help="Delete; without it, only print what would be deleted.")] = False,
) -> None:
    """Delete a run's old eval-point flow runs beyond its latest N steps (a preview unless --yes).

    Never deleted: a step in flight, a step its staging block keeps as one of the best K, a step's
    final flow run when the step has no row in its JSONL ledger (its only record). Older attempts
    of a step go; its final run goes only when its rows are in the ledger (`status` reads it there)."""
    from app.prune import PruneError, apply_prune, plan_prune  # prefect: slow import; `--help` stays fast

    with prefect_client() as client:
        try:
            plan = plan_prune(client, run, keep_last)
        except PruneError as exc:
            fail(f"{exc}; nothing deleted")
        if not plan.points:
            fail(f"no eval point of run {run!r} is recorded")
        for line in plan.lines():
            typer.echo(line)
        if not plan.delete:
            typer.echo("nothing to delete")
            return
        if not yes:
            typer.echo("nothing deleted: pass --yes to delete")
            return
        deleted = apply_prune(client, plan)
    left = len(plan.delete) - len(deleted)
    typer.echo(f"deleted {len(deleted)} flow run(s)"
               + (f"; {left} not deleted (back in flight or gone since the plan)" if left else ""))
