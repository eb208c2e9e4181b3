"""`pinned-eval fleet up|down|status`: start and stop a local fleet of engines behind sglang-router.

`up` returns once every engine and the router are ready and leaves them running detached (each in
its own process group); the state file (PIDs, start times, ports, commands) is what `down` and
the fleet client use later, from any process. Exit codes: 0 ok, 1 launch/stop failed, 2 bad usage.
Every engine and the router get an API key and an admin key, generated here (none is configured
on this CLI): they travel by environment or a 0600 file, never argv, and live in the state file
(0600, in a 0700 directory), where the fleet client and a launch-mode FleetBlock read them.
Launch errors are printed scrubbed of the keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from app.commands._cli import fail, refuse
from pinned_eval.fleet.launcher import LaunchedFleet, default_state_file, launch_cpu_fleet, launch_sglang_fleet
from pinned_eval.fleet.sglang_args import SGLangFleetSpec
from pinned_eval.processes import LaunchError

app = typer.Typer(help="Start and stop a fleet of engines behind sglang-router.", no_args_is_help=True)

StateFileOpt = Annotated[
    Path | None, typer.Option("--state-file", help="Fleet state file (default: <home>/fleet/fleet.json).")
]


def _state_path(state_file: Path | None) -> Path:
    return state_file or default_state_file()


def _json_arg(value: str | None, name: str) -> dict[str, Any]:
    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint=name) from exc
    if not isinstance(parsed, dict):
        raise typer.BadParameter("must be a JSON object of ServerArgs fields", param_hint=name)
    return parsed


@app.command("up")
def up(
    model_path: Annotated[Path, typer.Option("--model-path", help="HF snapshot the engines boot from.")],
    engines: Annotated[int, typer.Option("--engines", min=1, help="Number of engines.")] = 2,
    router_port: Annotated[int | None, typer.Option("--router-port", help="Router port (default: free).")] = None,
    weight_version: Annotated[str | None, typer.Option("--weight-version", help="Boot weight version.")] = None,
    state_file: StateFileOpt = None,
    policy: Annotated[str, typer.Option("--policy", help="round_robin or cache_aware.")] = "round_robin",
    backend: Annotated[str, typer.Option("--backend", help="cpu (bundled engine) or sglang (GPUs).")] = "cpu",
    gpus_per_engine: Annotated[int, typer.Option("--gpus-per-engine", min=1, help="sglang: TP size.")] = 1,
    sglang_args: Annotated[str | None, typer.Option("--sglang-args", help="sglang: base args JSON.")] = None,
    sglang_overrides: Annotated[
        str | None, typer.Option("--sglang-overrides", help="sglang: per-fleet overrides JSON.")
    ] = None,
    ready_timeout_s: Annotated[float, typer.Option("--ready-timeout", help="Seconds to become ready.")] = 300.0,
) -> None:
    """Start N engines and the router; print their URLs; return when ready (processes keep running)."""

    if policy not in ("round_robin", "cache_aware", "random", "power_of_two"):
        raise typer.BadParameter(f"unknown policy {policy!r}", param_hint="--policy")
    if not model_path.is_dir():
        raise typer.BadParameter(f"{model_path} is not a directory", param_hint="--model-path")
    path = _state_path(state_file)
    if path.exists():
        running = LaunchedFleet.load(path).running()
        if any(running.values()):
            refuse(f"a fleet from {path} is still running; `pinned-eval fleet down` first")
        path.unlink()
    try:
        if backend == "cpu":
            fleet = launch_cpu_fleet(
                model_path.resolve(), engines, state_file=path, weight_version=weight_version,
                router_port=router_port, policy=policy, ready_timeout_s=ready_timeout_s,
            )
        elif backend == "sglang":
            spec = SGLangFleetSpec(
                model_path=str(model_path.resolve()), num_gpus=engines * gpus_per_engine,
                gpus_per_engine=gpus_per_engine, base_args=_json_arg(sglang_args, "--sglang-args"),
                overrides=_json_arg(sglang_overrides, "--sglang-overrides"), weight_version=weight_version,
            )
            fleet = launch_sglang_fleet(
                spec, log_dir=path.parent / "logs", state_file=path, router_port=router_port, policy=policy,
                ready_timeout_s=ready_timeout_s,
            )
        else:
            raise typer.BadParameter(f"unknown backend {backend!r}", param_hint="--backend")
    except LaunchError as exc:
        fail(f"fleet up failed: {exc}")
    for url in fleet.engine_urls:
        typer.echo(f"engine {url}")
    typer.echo(f"router {fleet.router_url}")
    typer.echo(f"state {path}")


@app.command("down")
def down(state_file: StateFileOpt = None) -> None:
    """Stop the fleet recorded in the state file (router and engines, by PID/process group)."""

    path = _state_path(state_file)
    if not path.exists():
        typer.echo(f"no fleet state at {path}; nothing to stop", err=True)
        return
    fleet = LaunchedFleet.load(path)
    try:
        fleet.stop()
    except LaunchError as exc:
        fail(f"fleet down failed: {exc}")
    typer.echo(f"stopped {len(fleet.engine_urls)} engines and the router from {path}")


@app.command("status")
def status(state_file: StateFileOpt = None) -> None:
    """Print each recorded process and whether it is still running (by PID)."""

    path = _state_path(state_file)
    if not path.exists():
        fail(f"no fleet state at {path}: is the fleet up? `pinned-eval fleet up --model-path DIR`")
    for name, alive in LaunchedFleet.load(path).running().items():
        typer.echo(f"{name} {'running' if alive else 'stopped'}")
