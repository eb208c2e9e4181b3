"""The `pinned-eval` command line. Every verb lives in `app/commands/<family>.py`;
the engine's verbs come from `engine.cli` (the engine's own entry is `python -m engine`).

Exit codes: 0 success; 1 the operation failed (message on stderr); 2 bad usage or input (refused
before anything is sent); `request --wait` / `rerun --wait`: 3 the point ended Skipped, 4 it ended
Failed, Crashed or Cancelled (`app.commands.points.EXIT_SKIPPED`, `EXIT_FAILED`; docs/cli.md).
Every verb finds the Prefect API in the home (`PINNED_EVAL_HOME`: the URL `server up` recorded in
`stack.json`, the credential in `api-auth`); an exported `PREFECT_API_URL` wins.
Errors: one boundary (`app.commands._cli`): `error: <one line>` on stderr and the exit code above;
an unexpected error is one line too, its traceback only with `--debug` (or PINNED_EVAL_DEBUG=1).
Heavy imports (torch, transformers, prefect) happen inside the verbs, so `--help` is fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from app.commands import best, blocks, demo, fleet, history, init, points, results, snapshot, stack, suite
from app.commands._cli import DEBUG_ENV, PinnedTyper, guard_all, set_debug
from engine import cli as engine

app = PinnedTyper(
    name="pinned-eval",
    help="Evaluation points for fully-async RL training, one Prefect flow run per pinned weight version.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help=f"Print the traceback of an unexpected error (or {DEBUG_ENV}=1).")
    ] = False,
) -> None:
    set_debug(debug)


app.add_typer(engine.app, name="engine")
app.add_typer(fleet.app, name="fleet")
app.add_typer(snapshot.app, name="snapshot")
app.add_typer(suite.app, name="suite")
app.add_typer(blocks.app, name="block")
app.command("init")(init.init)
app.command("tiny-model")(snapshot.tiny_model)
app.command("export")(snapshot.export)
app.add_typer(stack.server_app, name="server")
app.command("deploy")(stack.deploy)
app.command("worker")(stack.worker)
app.command("demo")(demo.demo)
app.command("request")(points.request)
app.command("rerun")(points.rerun)
app.command("status")(history.status)
app.command("report")(history.report)
app.command("janitor")(history.janitor)
app.command("prune")(history.prune)
app.command("best")(best.best)
app.command("compare")(results.compare)
app.command("rescore")(results.rescore)
guard_all(app)  # CliRunner and `python -m` build the command without `PinnedTyper.__call__`


if __name__ == "__main__":
    app()
