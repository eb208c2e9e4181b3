"""`pinned-eval demo`: the whole product on one machine, on the embedded defaults.

Starts (and, on exit or Ctrl-C, stops by PID) a Prefect server on 127.0.0.1 (SQLite, filesystem
lease storage), the deployments and a process worker, a CPU fleet of 2 engines behind
sglang-router; saves the blocks; then runs a tiny fully-async training job on CPU that learns
arithmetic and dispatches an eval point every `eval_every` steps through `EvalClient` (in-loop
export into staging, final point forced, a baseline point at step 0). It ends with the per-step
table and the UI address where runs `demo/step-N` show the history. The server's API requires
the stack's credential (`<home>/api-auth`, mode 0600), which the UI's login form asks for.

One home: the demo runs on the stack of the pinned-eval home (`PINNED_EVAL_HOME`, default
`.pinned-eval`) — the server recorded there when one is up, else one it starts there (on the
home's recorded port when free) — so its history stays in the home's database after it exits:
`pinned-eval server up` reopens it and `pinned-eval status --run demo` reads it, with no variable
exported. Its files (tiny model, staging, spool, metrics) live in `<home>/demo`, and its blocks
are saved under the name `demo`, so the home's `default` blocks stay the user's own. Each demo
starts from a clean slate, so it can be run again and again: `<home>/demo` is emptied and the
flow runs of run `demo` left by an earlier demo are deleted first. It stops only what it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from app.prefect_server import private_dir, use_server
from app.stack import LocalStack, StackState
from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
from pinned_eval.events import BlockNames
from pinned_eval.points import SnapshotSource, SourceKind
from pinned_eval.processes import pid_alive, stop_groups
from pinned_eval.settings import get_settings
from pinned_eval.suite import default_suite
from trainer_integration.client import EvalClient

if TYPE_CHECKING:
    from trainer_integration.results import PointOutcome

RUN = "demo"
BLOCKS = BlockNames(suite=RUN, fleet=RUN, staging=RUN, sinks=RUN)  # the home's `default` ones stay the user's


class DemoOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(default=700, ge=1, description="Training steps (warm-up included).")
    warmup_steps: int = Field(default=300, ge=0, description="Supervised steps before RL.")
    eval_every: int = Field(default=100, ge=1, description="An eval point every this many steps.")
    policy: str = Field(default="backpressure", pattern="^(backpressure|skip)$")
    max_in_flight: int = Field(default=2, ge=1)
    port: int | None = Field(
        default=None, description="Prefect server port (default: the home's last one, else 4200, when free)."
    )
    exit_after: bool = Field(
        default=False, description="Stop everything after the table (without a terminal it always does)."
    )
    home: Path | None = Field(default=None, description="The pinned-eval home (default PINNED_EVAL_HOME).")


class _Started:
    """Everything the demo started, stopped in reverse order (by PID, via the owners' stop methods)."""

    def __init__(self) -> None:
        self._stops: list[tuple[str, Callable[[], object]]] = []

    def add(self, what: str, stop: Callable[[], object]) -> None:
        self._stops.append((what, stop))

    def stop_all(self, say: Callable[[str], None]) -> None:
        while self._stops:
            what, stop = self._stops.pop()
            say(f"stopping {what}")
            stop()


def run_demo(opts: DemoOptions, say: Callable[[str], None] = print) -> list[dict[str, object]]:
    """Run the demo; returns the per-step table rows (also printed)."""

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # quiet transformers in every child too
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    stack = LocalStack((opts.home or get_settings().home).resolve())
    home = stack.home / "demo"
    started = _Started()
    try:
        say("starting the Prefect server on 127.0.0.1 ...")
        before = stack.state()
        server = stack.server_up(opts.port)
        if server.pid != before.server_pid:
            started.add("the Prefect server and worker", stack.down)
        else:  # the home's server was up: stop only the worker and companions this demo starts
            started.add("the worker", lambda: _stop_new(stack, before))
        with use_server(server.api_url, server.home, auth_string=server.auth_string):
            _clean_slate(home)
            base = _tiny_model(home, say)
            fleet = _save_blocks(home, base)
            say("starting 2 CPU engines behind sglang-router ...")
            launched = fleet.launch(ready_timeout_s=600)
            started.add("the CPU fleet", launched.stop)
            say("deploying eval-point and starting a process worker ...")
            stack.deploy()
            stack.worker_up()
            outcomes = _train_and_evaluate(opts, home, base, server.api_url, say)
            table = [_row(o) for o in outcomes]
            comparison = _compare_last_two(table)
        say(render_table(table))
        for why in _unmeasured(outcomes):
            say(why)
        for line in comparison:
            say(line)
        say(
            f"\nPrefect UI: {server.ui_url}/runs  (flow runs named {RUN}/step-N; "
            f"log in with the contents of {stack.auth_file})"
        )
        say(
            f"The history stays in {stack.home}: `pinned-eval status --run {RUN}` (after `pinned-eval server up` "
            "once the demo has stopped)"
        )
        if not opts.exit_after and (sys.stdin.isatty() or get_settings().demo_hold):
            say("everything stays up for you to browse; Ctrl-C stops it all")
            _wait_for_interrupt()
        return table
    finally:
        started.stop_all(say)


def _stop_new(stack: LocalStack, before: StackState) -> None:
    """Stop the worker, warm-start server and backend host recorded now but not in `before`."""
    now = stack.state()
    pids = [pid for field in ("worker_pid", "warm_pid", "backend_host_pid")
            if (pid := getattr(now, field)) and pid != getattr(before, field) and pid_alive(pid)]
    stop_groups(pids, grace_s=60)


def _clean_slate(home: Path) -> None:
    """Empty `<home>/demo` and delete the flow runs of run `demo` an earlier demo left (their
    idempotency keys would otherwise hand this demo's points the old runs)."""
    from prefect import get_client  # prefect: already imported by the stack; kept local like the rest

    from flows.point_runs import point_flow_runs

    shutil.rmtree(home, ignore_errors=True)
    private_dir(home)
    with get_client(sync_client=True) as client:
        for fr in point_flow_runs(client, RUN):
            client.delete_flow_run(fr.id)


def _tiny_model(home: Path, say: Callable[[str], None]) -> Path:
    from engine.tiny_model import make_tiny_model  # torch/transformers: slow import, only when the demo runs

    say("making a tiny model and tokenizer (offline) ...")
    return make_tiny_model(home / "base-model", seed=0)


def _save_blocks(home: Path, base: Path) -> FleetBlock:
    fleet = FleetBlock(name="demo", mode="launch", backend="cpu", engines=2, model_path=str(base),
                       state_file=str(home / "fleet" / "fleet.json"))
    fleet.save(BLOCKS.fleet, overwrite=True)
    EvalSuiteBlock(suite=default_suite()).save(BLOCKS.suite, overwrite=True)
    # the baseline point reads the base model (an `hf` source): its directory is a source root
    StagingBlock(root=str(home / "staging"), keep_snapshots=2, source_roots=[str(base)]).save(
        BLOCKS.staging, overwrite=True
    )
    SinksBlock(jsonl_path=str(home / "metrics.jsonl"), results_root=str(home / "results")).save(
        BLOCKS.sinks, overwrite=True
    )
    return fleet


def _compare_last_two(table: list[dict[str, object]]) -> list[str]:
    """The examples that flipped between the last two measured steps, and where the samples are."""
    from app.commands.results import demo_summary  # pyarrow: only when the demo runs

    measured = [int(str(r["step"])) for r in table if r["state"] == "measured"]
    if len(measured) < 2:
        return []
    return ["", *demo_summary(RUN, measured[-2], measured[-1], sinks=BLOCKS.sinks)]


def _train_and_evaluate(
    opts: DemoOptions, home: Path, base: Path, api_url: str, say: Callable[[str], None]
) -> list[PointOutcome]:
    from app.demo.trainer import DemoConfig, DemoTrainer  # torch/transformers: slow import, only when the demo runs

    config = DemoConfig(work_dir=home / "trainer", base_model_dir=base, warmup_steps=opts.warmup_steps)
    client = EvalClient(
        RUN, api_url, blocks=BLOCKS, policy=opts.policy, max_in_flight=opts.max_in_flight,  # type: ignore[arg-type]
        staging_root=home / "staging", spool_dir=home / "spool",
    )
    try:
        with DemoTrainer(config) as trainer:
            client.dispatch(
                0, source=SnapshotSource(kind=SourceKind.HF, path=str(base), require_marker=False), final=False
            )  # baseline: the untrained model, never deleted
            say(f"training {opts.steps} steps; an eval point every {opts.eval_every} steps ...")
            t0 = time.monotonic()
            for _ in range(opts.steps):
                stats = trainer.train_step()
                step = stats.step
                client.report_progress(step)
                final = step == opts.steps
                if step % opts.eval_every == 0 or final:
                    res = client.dispatch(step, final=final, export=trainer.exporter())
                    say(f"  step {step:4d} {stats.phase:6s} loss {stats.loss:.3f} -> eval point {res.action} "
                        f"(loop stalled {res.stall_seconds * 1000:.0f} ms)")
            say(f"training done in {time.monotonic() - t0:.0f}s; waiting for the last eval points ...")
        outcomes = client.drain(timeout=900)
    finally:
        client.close()
    return outcomes


def _unmeasured(outcomes: list[PointOutcome]) -> list[str]:
    """One line per point that was not measured: its state, reason and message (the table has no room)."""
    return [f"step {o.step}: {o.state} ({o.reason}): {o.message}" for o in outcomes if o.state != "measured"]


def _row(outcome: PointOutcome) -> dict[str, object]:
    row: dict[str, object] = {"step": outcome.step, "state": outcome.state}
    version, lag = None, None
    for ds, m in sorted(outcome.metrics.items()):
        if ds is None:
            continue
        row[ds] = m.get(f"eval/{ds}")
        version = m.get(f"eval/{ds}/weight_version/mean", version)
        lag = m.get("eval/lag_steps", lag)
    row["weight_version"] = None if version is None else f"{version:g}"
    row["lag"] = None if lag is None else int(lag)
    row["reason"] = outcome.reason or ""
    return row


def render_table(rows: list[dict[str, object]]) -> str:
    if not rows:
        return "(no eval points)"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _cell(v: object) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _wait_for_interrupt() -> None:
    """Block until Ctrl-C (SIGINT) or SIGTERM; the caller's `finally` then stops everything.
    SIGINT is reset to Python's default handler first: a demo started with SIGINT ignored (e.g.
    from a background job of a non-interactive shell) would otherwise never stop on Ctrl-C."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, stop)
    with contextlib.suppress(KeyboardInterrupt):
        signal.pause()
