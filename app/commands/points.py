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

Exit codes: 0 done (with `--wait`: the point was measured); 1 the operation failed (no such point,
still in flight, snapshot gone, Prefect unreachable, wait timed out); 2 bad input, refused before
anything is sent (bad option, missing local path, unsaved block, existing step with another
source); with `--wait`, 3 the point ended Skipped, 4 it ended Failed, Crashed or Cancelled.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, cast
from uuid import UUID

import httpx
import typer
from pydantic import ValidationError

from app.commands._cli import STEP, fail, in_words
from app.commands.errors import human_errors
from pinned_eval.events import BlockNames, point_event
from pinned_eval.inflight import RETRYABLE, TERMINAL
from pinned_eval.points import PointRequest, SnapshotSource, SourceKind, flow_run_name, outcome_of
from pinned_eval.polling import PollTimeout, poll_until
from pinned_eval.settings import AUTH_FILE_ENV, PrefectApiSettings, get_settings
from pinned_eval.snapshot.layout import join, resolve
from pinned_eval.snapshot.staging import RETIRED

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

    from app.history import FlowRunRecord

DEFAULT_DEPLOYMENT = "eval-point/eval-point"
WORK_POOL = "pinned-eval"  # the pool `pinned-eval deploy` creates and `pinned-eval worker` polls
SOURCE_KINDS = ", ".join(k.value for k in SourceKind)  # --help and the errors say the same
# `request --wait` / `rerun --wait` exit codes by the point's outcome (0: measured)
EXIT_SKIPPED = 3
EXIT_FAILED = 4
# the flag naming each block a point loads, and that block's type slug
BLOCK_FLAGS = {"suite": "pinned-eval-suite", "fleet": "pinned-eval-fleet", "staging": "pinned-eval-staging",
               "sinks": "pinned-eval-sinks"}
SOURCE_FLAGS = {"kind": "--source", "path": "--source", "hf_base": "--hf-base", "source": "--source"}
REQUEST_FLAGS = {**SOURCE_FLAGS, "run": "--run", "step": "--step", "max_in_flight": "--max-in-flight",
                 "policy": "--policy", "posture": "--posture", **{b: f"--{b}" for b in BLOCK_FLAGS}}

RunOpt = Annotated[str, typer.Option("--run", help="Training run name, e.g. exp42.")]
StepOpt = Annotated[int, typer.Option("--step", parser=STEP, help="Training step of the point.")]
WaitOpt = Annotated[bool, typer.Option("--wait", help="Wait for the point's terminal state and print it.")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=1, help="Seconds --wait waits at most.")]
DeploymentOpt = Annotated[
    str, typer.Option("--deployment", help="Deployment that runs new points (<flow>/<deployment>).")
]


@contextlib.contextmanager
def prefect_client() -> Iterator[SyncPrefectClient]:
    """A sync client of the API, this process pointed at it while the block runs (flows run here
    too); exit 2 when none is configured, 1 when unreachable.

    The URL is `PREFECT_API_URL`, else the one `pinned-eval server up` recorded in the home; the
    credential is `PREFECT_API_AUTH_STRING` or `PINNED_EVAL_API_AUTH_FILE`, else the home's
    `api-auth`, sent only to the home's own server (never to another URL)."""
    from prefect import get_client  # prefect: slow import; `pinned-eval --help` stays fast
    from prefect.settings import get_current_settings  # prefect: slow import; `pinned-eval --help` stays fast

    from app.prefect_server import use_server  # prefect: slow import; `pinned-eval --help` stays fast
    from app.stack import LocalStack  # prefect: slow import; `pinned-eval --help` stays fast

    stack = LocalStack(get_settings().home)
    recorded = stack.state().api_url
    current = get_current_settings().api
    url = current.url or recorded
    if not url:
        fail("no Prefect API: run `pinned-eval server up`, or set PREFECT_API_URL "
             "(e.g. `export PREFECT_API_URL=http://127.0.0.1:4200/api`)", 2)
    try:
        configured = current.auth_string or PrefectApiSettings().api_auth_string
    except (OSError, ValueError) as exc:
        fail(f"{AUTH_FILE_ENV}: {exc}", 2)
    auth = configured.get_secret_value() if configured is not None else None
    if auth is None and url == recorded and stack.auth_file.exists():
        auth = stack.auth_string()
    current_auth = current.auth_string.get_secret_value() if current.auth_string is not None else None
    same = url == current.url and auth == current_auth  # nothing to change
    check_reachable(url)
    try:
        with (contextlib.nullcontext() if same else use_server(url, auth_string=auth),
              get_client(sync_client=True) as client):
            try:
                yield client
            finally:
                drain_events()
    except httpx.TransportError as exc:
        unreachable(url, exc)


def unreachable(url: str, exc: BaseException) -> NoReturn:
    """Exit 1: the API at `url` does not answer; say where the URL came from and how to start a server."""
    stack_home = get_settings().home
    from_home = os.environ.get("PREFECT_API_URL") != url
    hint = (f" (the server {stack_home} recorded: is it up? `pinned-eval server up`)" if from_home else
            " (PREFECT_API_URL): is that server up? `pinned-eval server up` starts this home's")
    fail(f"cannot reach the Prefect API at {url}{hint}: {in_words(exc)}")


def check_reachable(url: str) -> None:
    """One plain `GET /health` (no retries) before the verb: a server that is down is one line naming
    `pinned-eval server up` at once, whatever Prefect call the verb would have failed in, and after
    however many retries."""
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=10.0)
    except httpx.TransportError as exc:
        unreachable(url, exc)
    except httpx.InvalidURL as exc:
        fail(f"the Prefect API URL {url!r} is not a URL: {in_words(exc)}", 2)


EVENTS_DRAIN_S = 5.0


def drain_events() -> None:
    """Send the events Prefect's client queued (a block load emits one) while this process still
    points at the server, and stop its events thread: left to the interpreter's exit, the drain took
    seconds and raced native threads' teardown (pyarrow's), aborting `compare` (exit 134,
    "terminate called without an active exception") after it printed its answer."""
    import logging

    from prefect.events.worker import EventsWorker  # prefect: slow import; `pinned-eval --help` stays fast

    quiet = logging.getLogger(EventsWorker.__name__)  # its "Still processing items: 1 items remaining..."
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        EventsWorker.drain_all(timeout=EVENTS_DRAIN_S)
    finally:
        quiet.setLevel(level)


def parse_source(text: str, hf_base: str | None) -> SnapshotSource:
    """`KIND:PATH` (e.g. `staged:/stage/exp42/step_00000120`, `hf:s3://b/p`) → a validated source
    (exit 2 naming the flag when it is not one)."""

    kind, sep, path = text.partition(":")
    if not sep or not path or kind not in {k.value for k in SourceKind}:
        fail(f"--source: {text!r} must be KIND:PATH with KIND one of {SOURCE_KINDS}", 2)
    try:
        return SnapshotSource(kind=kind, path=absolute(path), hf_base=absolute(hf_base))  # type: ignore[arg-type]
    except ValidationError as exc:
        fail(human_errors(exc, SOURCE_FLAGS), 2)


def absolute(path: str | None) -> str | None:
    """A local path made absolute here, where the user typed it (the worker runs in another
    directory); URLs and None unchanged. Symlinks are kept (the worker's root check resolves them)."""
    if path is None or "://" in path or "\x00" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def check_source_roots(client: SyncPrefectClient, source: SnapshotSource, staging: str) -> None:
    """Exit 2 when `source` lies outside the staging block's source roots (the flow would refuse it
    unread), before anything is sent; the message says how to declare a root."""
    from pinned_eval.source_roots import SourceOutsideRoots, check_within_roots

    doc = client.read_block_document_by_name(staging, BLOCK_FLAGS["staging"], include_secrets=False)
    root = doc.data.get("root")
    if doc.data.get("s3_bucket_block"):  # a prefect-aws S3Bucket names the root (its bucket and folder)
        from prefect.exceptions import ObjectNotFound

        from pinned_eval.aws_bucket import S3_BUCKET_SLUG, s3_bucket_url

        name = str(doc.data["s3_bucket_block"])
        try:
            bucket = client.read_block_document_by_name(name, S3_BUCKET_SLUG, include_secrets=False)
        except ObjectNotFound:
            fail(f"--staging: staging block {staging!r} names the S3Bucket block {name!r}, which does not exist; "
                 "nothing was sent", 2)
        root = s3_bucket_url(bucket.data)
    roots = [str(root), *map(str, doc.data.get("source_roots") or [])]
    for flag, path in (("--source", source.path), ("--hf-base", source.hf_base)):
        if path is None:
            continue
        try:
            check_within_roots(path, roots, flag)
        except SourceOutsideRoots:
            fail(f"{flag}: {path} is outside the source roots of staging block {staging!r} ({', '.join(roots)}); "
                 "nothing was sent. Move the checkpoint under one of them, or declare its directory: "
                 "`source_root:` in pinned-eval.yaml then `pinned-eval block apply pinned-eval.yaml`, or "
                 f"`pinned-eval block save staging {staging} --root ROOT --source-root DIR --overwrite`", 2)


def check_local_paths(source: SnapshotSource) -> None:
    """Exit 2 when a local path of `source` does not exist (URLs are the worker's to read)."""
    for flag, path in (("--source", source.path), ("--hf-base", source.hf_base)):
        if path and "\x00" in path:
            fail(f"{flag}: a path cannot contain a NUL byte; nothing was sent", 2)
        if path and "://" not in path and not os.path.exists(path):
            fail(f"{flag}: {path} does not exist; nothing was sent", 2)


def block_exists(client: SyncPrefectClient, kind: str, name: str) -> bool:
    """Whether a `kind` block (a key of `BLOCK_FLAGS`) named `name` is saved on the server."""
    from prefect.exceptions import ObjectNotFound  # prefect: slow import; `pinned-eval --help` stays fast

    try:
        client.read_block_document_by_name(name, BLOCK_FLAGS[kind], include_secrets=False)
    except ObjectNotFound:
        return False
    return True


def check_blocks(client: SyncPrefectClient, blocks: BlockNames) -> None:
    """Exit 2, naming every flag whose block is not saved on the server, before anything is sent."""
    missing = [f"--{kind}: no {slug} block named {getattr(blocks, kind)!r}" for kind, slug in BLOCK_FLAGS.items()
               if not block_exists(client, kind, getattr(blocks, kind))]
    if missing:
        fail("; ".join(missing) + "; nothing was sent. Save the blocks first (`pinned-eval block save --help`), "
             "or name saved ones", 2)


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
