"""The engine's command line: `python -m engine` (= `serve`), also mounted by the app as
`pinned-eval engine serve` (`pinned-eval tiny-model` is the app's: it marks the model complete,
which the engine, a leaf, cannot).

Keys: `--api-key`/`--admin-api-key` exist for SGLang parity, but a flag is visible to every local
user in `ps`; launchers pass them in the environment instead (`API_KEY_ENV`, `ADMIN_API_KEY_ENV`),
which only the engine's own user can read.
`serve` imports torch/transformers lazily so `pinned-eval --help` stays fast. Exit codes:
0 success, 1 the engine failed, 2 bad usage (typer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from engine.launch import ADMIN_API_KEY_ENV, API_KEY_ENV, EngineArgs
from engine.protocol import describe
from engine.scripted import ScriptError, load_rules

app = typer.Typer(help="The bundled CPU engine that speaks SGLang's native HTTP API.", no_args_is_help=True)


@app.command("serve")
def serve(
    model_path: Annotated[str, typer.Option(help="HF snapshot directory to serve.")],
    port: Annotated[int, typer.Option(help="TCP port to listen on.")],
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    weight_version: Annotated[str, typer.Option(help="Initial weight version label.")] = "default",
    served_model_name: Annotated[str | None, typer.Option(help="Model id (default: the model path).")] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar=API_KEY_ENV, show_envvar=True, help="Bearer key for normal endpoints.")
    ] = None,
    admin_api_key: Annotated[
        str | None,
        typer.Option(envvar=ADMIN_API_KEY_ENV, show_envvar=True, help="Bearer key for control endpoints."),
    ] = None,
    threads: Annotated[int, typer.Option(help="torch intra-op threads.")] = 1,
    max_batch_size: Annotated[int, typer.Option(help="Most sequences decoded together.")] = 64,
    context_length: Annotated[int | None, typer.Option(help="Context length (default: the model's).")] = None,
    health_timeout: Annotated[float, typer.Option(help="Seconds /health waits for its probe token.")] = 20.0,
    tool_call_parser: Annotated[
        str | None, typer.Option(help="Parse tool calls in /v1/chat/completions like SGLang's: qwen25 or hermes.")
    ] = None,
    scripted_completions: Annotated[
        str | None, typer.Option(help="TESTS ONLY: JSON rules file of prompt substring -> completion.")
    ] = None,
) -> None:
    """Serve a model with SGLang's native HTTP API on CPU (foreground, until SIGINT/SIGTERM)."""

    try:
        args = EngineArgs(
            model_path=model_path,
            port=port,
            host=host,
            weight_version=weight_version,
            served_model_name=served_model_name,
            api_key=api_key,
            admin_api_key=admin_api_key,
            threads=threads,
            max_batch_size=max_batch_size,
            context_length=context_length,
            health_timeout_s=health_timeout,
            tool_call_parser=tool_call_parser,  # type: ignore[arg-type]  # validated by EngineArgs
            scripted_completions=scripted_completions,
        )
    except ValidationError as err:
        typer.echo(f"engine serve: {describe(err)}", err=True)
        raise typer.Exit(code=2) from None
    if scripted_completions is not None:
        try:
            load_rules(scripted_completions)
        except ScriptError as err:
            typer.echo(f"engine serve: {err}", err=True)
            raise typer.Exit(code=2) from None
    if not Path(model_path).is_dir():
        typer.echo(f"engine serve: --model-path {model_path} is not a directory", err=True)
        raise typer.Exit(code=2)
    from engine.server import serve as run_server  # torch/transformers: `--help` stays fast

    run_server(args)
