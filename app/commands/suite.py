"""`pinned-eval suite miles FILE`: load miles' eval config as miles reads it, print the suite it
means, optionally save it as an EvalSuite block (`--save NAME`).

`--set NAME=VALUE` (repeatable) resolves `${NAME}` / `${oc.env:NAME}` ahead of the environment;
`--strict-miles` refuses pinned-eval's extension keys; `--rm-type` is miles' `--rm-type`.
`--save` saves on the home's server, as every verb (`app.commands.points.prefect_client`): none
recorded is exit 2 naming `pinned-eval server up`, never a throwaway server or Prefect's own database.
Exit codes: 0 loaded (and saved); 2 the config is refused (message names the key), a `--set` is
malformed, `--save` is not a block name or no server is configured; 1 saving the block failed
(Prefect unreachable).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from app.commands._cli import refuse

app = typer.Typer(help="Eval suites: load miles' eval config.", no_args_is_help=True)


def _variables(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.isidentifier():
            raise typer.BadParameter(f"{pair!r}: expected NAME=VALUE", param_hint="--set")
        out[name] = value
    return out


@app.command("miles")
def miles(
    path: Annotated[Path, typer.Argument(help="miles eval config (YAML/JSON).", exists=True, dir_okay=False)],
    set_: Annotated[list[str] | None, typer.Option("--set", help="NAME=VALUE for ${NAME} interpolations.")] = None,
    strict_miles: Annotated[bool, typer.Option("--strict-miles", help="Refuse pinned-eval's extension keys.")] = False,
    rm_type: Annotated[
        str | None, typer.Option("--rm-type", help="miles' --rm-type: reward of datasets without one.")
    ] = None,
    save: Annotated[str | None, typer.Option("--save", help="Save as this EvalSuite block name.")] = None,
) -> None:
    """Print the datasets a miles eval config means (after interpolation, defaults, fallbacks)."""
    from pinned_eval.suite import EvalSuite

    variables = _variables(set_ or [])
    if save is not None:
        from app.block_specs import SpecError, validate_name

        try:
            validate_name(save)
        except SpecError as exc:
            refuse(f"--save: {exc.message}")
    try:
        suite = EvalSuite.from_miles_yaml(path, variables=variables, strict_miles=strict_miles, rm_type=rm_type)
    except (ValueError, FileNotFoundError) as exc:
        refuse(str(exc))
    typer.echo(json.dumps([ds.model_dump(mode="json") for ds in suite.resolved()], indent=2))
    if save:
        from app.commands.points import prefect_client  # prefect: slow import; `--help` stays fast
        from blocks import EvalSuiteBlock  # prefect: slow import; `pinned-eval --help` stays fast

        with prefect_client():  # the home's server, as every verb: never a throwaway one
            EvalSuiteBlock(suite=suite).save(save, overwrite=True)
        typer.echo(f"saved suite block {save!r}", err=True)
