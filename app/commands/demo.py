"""`pinned-eval demo`: the whole product on one machine (see `app.demo.run`).

It runs on the home's stack, so its history stays browsable after it exits (`pinned-eval server
up`, then `pinned-eval status --run demo`); `PINNED_EVAL_DEMO_HOLD=1` keeps it up after its table
without a terminal. Exit codes: 0 the demo ran; 1 it failed (everything it started is stopped
either way).
"""

from __future__ import annotations

from typing import Annotated

import typer


def demo(
    steps: Annotated[int, typer.Option(help="Training steps (warm-up included).")] = 700,
    warmup_steps: Annotated[int, typer.Option(help="Supervised warm-up steps.")] = 300,
    eval_every: Annotated[int, typer.Option(help="An eval point every N steps.")] = 100,
    policy: Annotated[str, typer.Option(help="At the in-flight bound: backpressure or skip.")] = "backpressure",
    port: Annotated[
        int | None, typer.Option(help="Prefect server port (default: the home's last one, else 4200, if free).")
    ] = None,
    exit_after: Annotated[bool, typer.Option("--exit", help="Stop everything after printing the table.")] = False,
) -> None:
    """Train a tiny model on CPU and evaluate it every few steps, one Prefect flow run per point."""
    from app.demo.run import DemoOptions, run_demo  # torch, prefect: slow imports; `pinned-eval --help` stays fast

    run_demo(DemoOptions(steps=steps, warmup_steps=warmup_steps, eval_every=eval_every, policy=policy,
                         port=port, exit_after=exit_after))
