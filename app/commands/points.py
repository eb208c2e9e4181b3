"""`pinned-eval request|rerun`: ask for an eval point, or run a finished one again.

- `request` checks what it can before sending anything (a local source path exists, the named
  blocks are saved, an existing point of the step has the same source), then sends the point's
  `pinned-eval.point.requested` event (deterministic id: sending the same point twice is one flow
  run); `--force-new` creates a fresh deployment run of the step instead.
- `rerun` finds the step's latest flow run: Failed/Crashed/Cancelled deployment runs are retried
  in place (state Scheduled "AwaitingRetry", forced: same id, `run_count + 1`, like the UI's Retry
  button); Skipped points (and, with `--force`, measured ones) get a new deployment run with the
  same parameters and name. The snapshot must still be obtainable: a staged snapshot must be on
  staging and complete (it is taken out of the keep-ring so no other point deletes it meanwhile);
  megatron/state_dict/hf sources must still exist (the flow re-exports them).
Both verbs reach Prefect through `app.commands.api.prefect_client`; `request`'s checks before
sending are `app.commands.request_checks`.

Exit codes: 0 done (with `--wait`: the point was measured); 1 the operation failed (no such point,
still in flight, snapshot gone, Prefect unreachable, wait timed out); 2 bad input, refused before
anything is sent (bad option, missing local path, unsaved block, existing step with another
source); with `--wait`, 3 the point ended Skipped, 4 it ended Failed, Crashed or Cancelled.
"""

from __future__ import annotations

import contextlib
import os
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, cast
from uuid import UUID

import typer
from pydantic import ValidationError

from app.commands._cli import STEP, fail
from app.commands.api import prefect_client
from app.commands.errors import human_errors
from app.commands.request_checks import (
    BLOCK_FLAGS,
    REQUEST_FLAGS,
    SOURCE_KINDS,
    absolute,
    block_exists,
    check_blocks,
    check_local_paths,
    check_source_roots,
    parse_source,
)
from pinned_eval.events import BlockNames, point_event
from pinned_eval.inflight import RETRYABLE, TERMINAL
from pinned_eval.points import PointRequest, SnapshotSource, SourceKind, flow_run_name, outcome_of
from pinned_eval.polling import PollTimeout, poll_until
from pinned_eval.snapshot.layout import join, resolve
from pinned_eval.snapshot.staging import RETIRED

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

    from app.history import FlowRunRecord

# the verbs, and what other verbs and tests import from here (the API client lives in `api`, the
# request checks in `request_checks`; both stay importable from here)
__all__ = [
    "BLOCK_FLAGS",
    "EXIT_FAILED",
    "EXIT_SKIPPED",
    "RunOpt",
    "absolute",
    "block_exists",
    "check_source_roots",
    "fail",
    "no_worker_hint",
    "parse_source",
    "prefect_client",
    "request",
    "rerun",
    "step_runs",
    "untagged_runs",
]

DEFAULT_DEPLOYMENT = "eval-point/eval-point"
WORK_POOL = "pinned-eval"  # the pool `pinned-eval deploy` creates and `pinned-eval worker` polls
# `request --wait` / `rerun --wait` exit codes by the point's outcome (0: measured)
EXIT_SKIPPED = 3
EXIT_FAILED = 4

RunOpt = Annotated[str, typer.Option("--run", help="Training run name, e.g. exp42.")]
StepOpt = Annotated[int, typer.Option("--step", parser=STEP, help="Training step of the point.")]
WaitOpt = Annotated[bool, typer.Option("--wait", help="Wait for the point's terminal state and print it.")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=1, help="Seconds --wait waits at most.")]
DeploymentOpt = Annotated[
    str, typer.Option("--deployment", help="Deployment that runs new points (<flow>/<deployment>).")
]


def source_text(raw: object) -> str:
    """`KIND:PATH` of a source parameter (`none` for the shared posture)."""
    if not raw:
        return "none"
    src = SnapshotSource.model_validate(raw)
    return f"{src.kind.value}:{src.path}" + (f" --hf-base {src.hf_base}" if src.hf_base else "")


def step_runs(client: SyncPrefectClient, run: str, step: int) -> list[FlowRunRecord]:
    """Every flow run of the point, oldest first (one request, `step_point_flow_runs`: not the run's history)."""
    from app.history import FlowRunRecord  # prefect: slow import; `pinned-eval --help` stays fast
    from flows.point_runs import step_point_flow_runs  # prefect: slow import; `pinned-eval --help` stays fast

    records = [FlowRunRecord.from_prefect(fr) for fr in step_point_flow_runs(client, run, [step])]
    return sorted((r for r in records if r.step == step), key=lambda r: r.created)


def wait_terminal(client: SyncPrefectClient, flow_run_id: str, timeout_s: float) -> Any:
    """The flow run once its state is terminal; exit 1 after `timeout_s`."""
    last: Any = None

    def final() -> Any:
        nonlocal last
        last = client.read_flow_run(UUID(flow_run_id))
        return last if last.state is not None and last.state.is_final() else None

    try:
        return poll_until(final, timeout_s=timeout_s, interval_s=1.0, what="")
    except PollTimeout:
        state = last.state.name if last is not None and last.state else "Pending"
        hint = ""
        if last is None or last.state is None or last.state.type.value in ("SCHEDULED", "PENDING"):
            hint = "; " + no_worker_hint(client, getattr(last, "work_pool_name", None) or WORK_POOL)
        fail(f"{last.name if last else flow_run_id} ({flow_run_id}) still {state} after {timeout_s:.0f}s{hint}")


def no_worker_hint(client: SyncPrefectClient, pool: str) -> str:
    """Why a point may not start: no worker polls its pool (say how to start one), or the workers are busy."""
    try:
        workers = client.read_workers_for_work_pool(pool)
    except Exception:  # the pool itself is gone: same remedy
        workers = []
    if not any(str(getattr(w.status, "value", w.status)).upper() == "ONLINE" for w in workers):
        return (f"no worker is polling the work pool {pool!r}: start one with `pinned-eval worker` "
                "(in another terminal, in this project's directory)")
    return f"a worker polls {pool!r}: it may be busy with other points (`pinned-eval status --run RUN`)"


def untagged_runs(client: SyncPrefectClient, run: str, step: int) -> list[Any]:
    """Flow runs of the point that ended before the flow tagged them (e.g. a refused source):
    `step_runs` cannot see them; newest first, among the latest 200 terminal runs named after the point."""
    from prefect.client.schemas.filters import FlowFilter, FlowRunFilter
    from prefect.client.schemas.sorting import FlowRunSort

    from pinned_eval.inflight import POINT_FLOW, is_point_of

    runs = client.read_flow_runs(
        flow_filter=FlowFilter.model_validate({"name": {"any_": [POINT_FLOW]}}),
        flow_run_filter=FlowRunFilter.model_validate(
            {"name": {"any_": [flow_run_name(run, step)]}, "state": {"type": {"any_": list(TERMINAL)}}}
        ),
        sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=200,
    )
    return [fr for fr in runs if is_point_of(fr.parameters, run) and fr.parameters.get("step") == step
            and f"run:{run}" not in (fr.tags or [])]


def print_final(fr: Any) -> int:
    """Print the run's final state; return the exit code of its outcome (0 measured, `EXIT_SKIPPED`,
    `EXIT_FAILED` for Failed, Crashed and Cancelled)."""
    state = fr.state
    typer.echo(f"{fr.name} {fr.id}: {state.name} ({state.type.value.lower()}) {state.message or ''}".rstrip())
    outcome = outcome_of(state.type.value, state.name)
    return 0 if outcome == "measured" else EXIT_SKIPPED if outcome == "skipped" else EXIT_FAILED


def finish_wait(client: SyncPrefectClient, flow_run_id: str, timeout_s: float) -> NoReturn:
    """Wait for the run's terminal state, print it, exit with its outcome's code."""
    raise typer.Exit(print_final(wait_terminal(client, flow_run_id, timeout_s)))


def new_deployment_run(
    client: SyncPrefectClient, deployment: str, parameters: dict[str, Any], run: str, step: int
) -> Any:
    """A new flow run of `deployment` named `<run>/step-<step>`, tagged like the flow tags itself."""
    from prefect.deployments import run_deployment  # prefect: slow import; `pinned-eval --help` stays fast
    from prefect.exceptions import ObjectNotFound  # prefect: slow import; `pinned-eval --help` stays fast

    try:
        return run_deployment(
            deployment, parameters=parameters, timeout=0, flow_run_name=flow_run_name(run, step),
            tags=[f"run:{run}", f"step:{step}"], as_subflow=False,
        )
    except ObjectNotFound:
        fail(f"deployment {deployment!r} not found: deploy it with `prefect --no-prompt deploy --all`")


def request(
    run: RunOpt,
    step: StepOpt,
    source: Annotated[str | None, typer.Option("--source", help=f"KIND:PATH, KIND one of {SOURCE_KINDS}.")] = None,
    hf_base: Annotated[
        str | None, typer.Option("--hf-base", help="Base HF dir (megatron, state_dict, lora).")
    ] = None,
    final: Annotated[bool, typer.Option("--final", help="The run's final point: never skipped as busy.")] = False,
    posture: Annotated[Literal["fleet", "shared"], typer.Option(help="Eval posture.")] = "fleet",
    policy: Annotated[Literal["backpressure", "skip"], typer.Option(help="At the in-flight bound.")] = "backpressure",
    max_in_flight: Annotated[int, typer.Option("--max-in-flight", min=1, max=64, help="In-flight bound.")] = 2,
    suite: Annotated[str, typer.Option("--suite", help="EvalSuite block name.")] = "default",
    fleet: Annotated[str, typer.Option("--fleet", help="Fleet block name.")] = "default",
    staging: Annotated[str, typer.Option("--staging", help="Staging block name.")] = "default",
    sinks: Annotated[str, typer.Option("--sinks", help="Sinks block name.")] = "default",
    force_new: Annotated[
        bool, typer.Option("--force-new", help="A fresh point for the step (a new deployment run), even when "
                                               "the step already has one (e.g. with another --source).")
    ] = False,
    deployment: DeploymentOpt = DEFAULT_DEPLOYMENT,
    wait: WaitOpt = False,
    timeout: TimeoutOpt = 1800.0,
) -> None:
    """Request an ad-hoc eval point (the same event a trainer sends). Checked before anything is
    sent: a local --source/--hf-base path exists, the four blocks are saved, and an existing point
    of the step has the same source (else --force-new). With --wait, exit 0 measured, 3 skipped,
    4 failed."""

    src = parse_source(source, hf_base) if source else None
    try:
        req = PointRequest(run=run, step=step, source=src, final=final, posture=posture,  # type: ignore[arg-type]
                           policy=policy, max_in_flight=max_in_flight)
        blocks = BlockNames(suite=suite, fleet=fleet, staging=staging, sinks=sinks)
    except ValidationError as exc:
        fail(human_errors(exc, REQUEST_FLAGS), 2)
    if src is not None:
        check_local_paths(src)
    name = flow_run_name(run, step)
    with prefect_client() as client:
        check_blocks(client, blocks)
        if src is not None:
            check_source_roots(client, src, staging)
        if force_new:
            params = {**req.model_dump(mode="json"), **blocks.model_dump()}
            fr = new_deployment_run(client, deployment, params, run, step)
            typer.echo(f"created {name} {fr.id} (new run of {deployment})")
            flow_run_id = str(fr.id)
        else:
            existing = step_runs(client, run, step)
            if existing:
                last = existing[-1]
                asked = source_text(req.model_dump(mode="json")["source"])
                had = source_text(last.parameters.get("source"))
                if asked != had:
                    fail(f"{name} exists ({last.id}, {last.state_name}) with source {had}, not {asked}; nothing was "
                         "sent: `--force-new` requests a fresh point of the step with this source", 2)
                typer.echo(f"{name} exists: {last.id} {last.state_name}; use `pinned-eval rerun` or --force-new")
                flow_run_id = last.id
            elif early := untagged_runs(client, run, step):
                fr = early[0]
                why = f"{fr.state.name}: {fr.state.message}" if fr.state and fr.state.message else "ended early"
                fail(f"{name} was requested before ({fr.id}) and ended before it started ({why}); the same request "
                     "again would be ignored as that point. Fix the cause, then `--force-new` requests a fresh "
                     "point of the step", 2)
            else:
                sent_at = datetime.now(UTC)
                resp = client.request("POST", "/events", json=[point_event(req, blocks)])
                resp.raise_for_status()
                typer.echo(f"requested {name} (event {req.event_id})")
                if not wait:
                    return
                flow_run_id = _await_triggered(client, run, step, sent_at, min(timeout, 120.0))
        if wait:
            finish_wait(client, flow_run_id, timeout)


def _await_triggered(client: SyncPrefectClient, run: str, step: int, after: datetime, timeout_s: float) -> str:
    def fresh() -> str | None:
        runs = [r for r in step_runs(client, run, step) if r.created >= after.replace(microsecond=0)]
        return runs[-1].id if runs else None

    with contextlib.suppress(PollTimeout):
        return poll_until(fresh, timeout_s=timeout_s, interval_s=0.5, what="")
    fail(f"no flow run for {run}/step-{step} within {timeout_s:.0f}s: is the deployment's trigger active, "
         "or was this event id already used (then use --force-new)?")


def ensure_snapshot(client: SyncPrefectClient, last: FlowRunRecord) -> str:
    """Make sure the rerun can obtain its weights; return what was done (or exit 1 saying why not)."""
    from blocks import StagingBlock  # prefect: slow import; `pinned-eval --help` stays fast

    raw = last.parameters.get("source")
    if not raw:
        return "no snapshot (shared posture)"
    source = SnapshotSource.model_validate(raw)
    local = [p for p in (source.path, source.hf_base) if p and "://" not in p]
    if source.kind is not SourceKind.STAGED:
        gone = [p for p in local if not os.path.exists(p)]
        if gone:
            fail(f"{source.kind} source of {last.name} is gone ({', '.join(gone)}); it cannot be exported again. "
                 f"Request the step with a source that exists: `pinned-eval request --run {last.run} --step "
                 f"{last.step} --source {source.kind}:PATH{' --hf-base DIR' if source.hf_base else ''} --force-new`")
        return f"{source.kind} source present; the flow exports it again" if source.owned else "hf source present"
    staging = cast(StagingBlock, StagingBlock.load(str(last.parameters.get("staging", "default")))).staging()
    dest = staging.path_for(last.run, last.step)
    check = staging.check(dest)
    if not check.complete:
        fail(f"staged snapshot {dest} of {last.name} is not available ({check.problem}: {check.detail}); a staged "
             "snapshot has no other copy: export the step again and `pinned-eval request --force-new`")
    fs, fs_path = resolve(dest, staging.storage_options)
    with contextlib.suppress(FileNotFoundError):  # out of the keep-ring while the rerun uses it
        fs.rm_file(join(fs, fs_path, RETIRED))
    return f"staged snapshot {dest} complete; taken out of the keep-ring"


def rerun(
    run: RunOpt,
    step: StepOpt,
    force: Annotated[bool, typer.Option("--force", help="Also rerun a measured point (as a new run).")] = False,
    deployment: DeploymentOpt = DEFAULT_DEPLOYMENT,
    wait: WaitOpt = False,
    timeout: TimeoutOpt = 1800.0,
) -> None:
    """Run a finished point again: retry a failed one in place, re-trigger a skipped one."""
    from prefect.states import Scheduled  # prefect: slow import; `pinned-eval --help` stays fast

    name = flow_run_name(run, step)
    with prefect_client() as client:
        runs = step_runs(client, run, step)
        if not runs and (early := untagged_runs(client, run, step)):
            fr = early[0]
            src = source_text(fr.parameters.get("source"))
            fail(f"{name} ({fr.id}) ended before it started ({fr.state.name if fr.state else 'no state'}: "
                 f"{(fr.state.message if fr.state else None) or 'no message'}); it cannot be rerun. Fix the cause, "
                 f"then request it again: `pinned-eval request --run {run} --step {step} --source {src} --force-new`")
        if not runs:
            fail(f"no flow run of {name}; request it with `pinned-eval request --run {run} --step {step} "
                 "--source KIND:PATH`")
        last = runs[-1]
        if last.state_type not in TERMINAL:
            fail(f"{name} is still {last.state_name} ({last.id}); wait for it or cancel it first")
        outcome = outcome_of(last.state_type, last.state_name)
        if outcome == "measured" and not force:
            fail(f"{name} was measured ({last.id}); pass --force to measure it again")
        typer.echo(ensure_snapshot(client, last))
        if last.state_type in RETRYABLE and last.deployment_id:
            client.set_flow_run_state(
                last.id, Scheduled(name="AwaitingRetry", message="Retried via pinned-eval rerun"), force=True
            )
            typer.echo(f"retrying {name} in place: {last.id} (was {last.state_name})")
            flow_run_id = last.id
        else:
            target = last.deployment_id or deployment
            fr = new_deployment_run(client, target, dict(last.parameters), run, step)
            typer.echo(f"re-triggered {name} as a new run {fr.id} (was {last.state_name} {last.id})")
            flow_run_id = str(fr.id)
        if wait:
            finish_wait(client, flow_run_id, timeout)
