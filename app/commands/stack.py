"""`pinned-eval server up|down`, `pinned-eval deploy`, `pinned-eval worker`: the local orchestration stack.

State (PIDs, API URL) lives in `<home>/stack.json` (home: `PINNED_EVAL_HOME`, default
`.pinned-eval`, mode 0700); the API credential the server requires in `<home>/api-auth` (mode
0600; `server up` generates it and prints its path, never its value). `worker` first checks that the
recorded server answers (else one line naming `pinned-eval server up`). Exit codes: 0 ok; 1 the
operation failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from app.commands import blocks
from app.commands._cli import fail
from pinned_eval.settings import get_settings

server_app = typer.Typer(help="A local Prefect server (SQLite, filesystem lease storage) on 127.0.0.1.",
                         no_args_is_help=True)


def _stack():
    from app.stack import LocalStack  # prefect: slow import; `pinned-eval --help` stays fast

    return LocalStack(get_settings().home)


@server_app.command("up")
def server_up(
    port: Annotated[int | None, typer.Option(help="Port (default: the home's last one, else 4200, if free).")] = None,
) -> None:
    """Start the server (or report the running one) with API auth on; print its API URL and where
    its credential is (the UI's login and other clients; the pinned-eval verbs read it themselves)."""
    stack = _stack()
    server = stack.server_up(port)
    typer.echo(f"Prefect UI: {server.ui_url}  (log in with the contents of {stack.auth_file.resolve()})\n"
               f"the pinned-eval verbs find it in {stack.home}; other clients take:\n"
               f"export PREFECT_API_URL={server.api_url}\n"
               f"export PINNED_EVAL_API_AUTH_FILE={stack.auth_file.resolve()}  # for EvalClient\n"
               f"export PREFECT_API_AUTH_STRING=\"$(cat {stack.auth_file.resolve()})\"  # for Prefect's own CLI")


@server_app.command("down")
def server_down() -> None:
    """Stop the worker and the server this home started."""
    stopped = _stack().down()
    typer.echo("stopped: " + (", ".join(stopped) or "nothing was running"))


def deploy() -> None:
    """Register block types, create the `pinned-eval` work pool and deploy prefect.yaml; then name
    each `default` block a point would miss and the command that creates it."""
    try:
        _stack().deploy()
    except RuntimeError as exc:
        fail(str(exc))
    typer.echo("deployed eval-point (trigger: pinned-eval.point.requested)")
    blocks.note_missing_blocks()


def worker(
    query_seconds: Annotated[float, typer.Option(help="How often the worker polls for runs.")] = 0.5,
    pool: Annotated[str, typer.Option(help="Work pool to take flow runs from.")] = "pinned-eval",
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Serve Prometheus metrics of the points on this port (0: any free one; docs/metrics.md)."),
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="Address the metrics endpoint binds.")] = "127.0.0.1",
) -> None:
    """Run a process worker on the `pinned-eval` pool in the foreground, with its warm-start fork
    server and backend host beside it (started first; recorded in `<home>/stack.json`).

    SIGTERM or SIGINT (Ctrl-C, `kill PID`, a supervisor's stop) stops the worker, then the
    warm-start server and the backend host this command started (the host disposes its backends),
    and exits 0. A flow run in flight gets SIGTERM first and is waited for: it ends Crashed and
    its snapshot is retired. If this command is SIGKILLed, the processes it started are killed with it
    (parent-death signal): nothing is left taking points. The tracker deliverer beside it sends
    the points' W&B and MLflow exports; those still waiting when it stops are named in one line
    and sent by the next worker. With `--metrics-port`, this process
    serves the points' Prometheus metrics at `http://<metrics-host>:<port>/metrics` (printed to
    stderr as `metrics: URL`), read from `<home>/metrics` (docs/metrics.md)."""
    stack = _stack()
    if not stack.state().api_url:
        fail(f"no server recorded in {stack.home}: start it with `pinned-eval server up` (and `pinned-eval deploy`)")
    from app.commands.points import prefect_client  # prefect: slow import; `pinned-eval --help` stays fast

    with prefect_client():  # a server that is down: one line naming `server up`, never a traceback
        pass
    server: Any = None
    extra_env: dict[str, str] = {}
    if metrics_port is not None:
        server, extra_env = _serve_metrics(stack.home / "metrics", metrics_port, metrics_host, stack.outbox())
    try:
        code = stack.run_worker(query_seconds=query_seconds, pool=pool, extra_env=extra_env)
    finally:
        if server is not None:
            server.shutdown()
    _note_waiting_exports(stack.outbox())
    raise typer.Exit(code)


def _note_waiting_exports(root: Path) -> None:
    """One line when tracker exports were left in the outbox (the deliverer's drain time ran out)."""
    from pinned_eval.sinks.outbox import envelopes_waiting

    waiting = envelopes_waiting(root)
    if waiting:
        typer.echo(f"{waiting} tracker export(s) (W&B, MLflow) wait in {root}: the next `pinned-eval worker` "
                   "sends them", err=True)


def _serve_metrics(root: Path, port: int, host: str, outbox: Path | None = None) -> tuple[Any, dict[str, str]]:
    """Start the endpoint; the environment that makes the worker's flow runs record into `root`."""
    from pinned_eval.prometheus import METRICS_DIR_ENV, private_metrics_dir, serve_metrics
    from pinned_eval.trusted_paths import UntrustedPathError

    if not 0 <= port <= 65535:
        fail(f"--metrics-port: {port} is not a port (0-65535)")
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        fail("--metrics-port: needs prometheus_client: pip install 'pinned-eval[prometheus]'")
    try:
        private_metrics_dir(root)
        server, url = serve_metrics(root, port, host, outbox)
    except UntrustedPathError as exc:
        fail(f"--metrics-port: {exc}")
    except OSError as exc:
        fail(f"--metrics-port: cannot serve on {host}:{port}: {exc.strerror or exc}")
    typer.echo(f"metrics: {url}", err=True)
    return server, {METRICS_DIR_ENV: str(root)}
