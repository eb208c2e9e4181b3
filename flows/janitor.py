"""The janitor flow: crash zombie eval points and retire staged snapshots no live point owns.

Covers what the `on_crashed` hook cannot: the loss of a worker host (or a SIGKILL of the worker
itself) leaves the point's flow run Running or Pending forever, its owned snapshot on staging and
no `skipped_crashed` row (OSS Prefect has no zombie reaper).

Liveness signal (what Prefect records for every flow run):
    last activity = max(flow-run state timestamp,
                        newest task-run state timestamp of the run,
                        newest `prefect.flow-run.heartbeat` event of the run)
The flow engine emits the heartbeat every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (default
180, minimum 30) from a daemon thread, even while one long task (generation) runs, so a live
point is never quiet for longer than that. Keep `heartbeat_window_s` at 3x the frequency or more
(default 600 s); with heartbeats disabled the window must exceed the longest single task.

A point quiet for longer than the window is stuck: its run is set to Crashed (message says
why), `pinned-eval.point.failed` is emitted (the point's flow run related), its owned snapshot is
retired (keep-ring), and `skipped_crashed` is recorded at its step (ledger row with the point's
flow-run id, then the exporters: the point's artifacts, W&B when configured). The Crashed transition is
not forced: the server refuses it once the run is terminal (ended by its `on_crashed` hook, or by
another janitor pass that read it Running too), and the janitor then does nothing more for that
point, so each crash is recorded and alerted once.

Every retire passes the staging block's best-K steps (`StagingBlock.protected_steps`, ranked from
the ledger of the point's sinks block, `default` for a snapshot no flow run names), as the
flow does, so a janitor pass trims the keep-ring and keeps the best K. A keep_best block whose
sinks have no JSONL file: logged, and the retire deletes nothing (`Staging.retire`).

Staging sweep: reads the flow runs of the unretired snapshots' steps only (`step_point_flow_runs`,
one request per run and 200 steps: its cost follows what is staged, not the runs' history). A
snapshot `<run>/step_<n>` that is not `.retired` is retired when no flow run of
(run, step) is in flight (`pinned_eval.inflight.in_flight`, the definition admission uses), or
when no flow run of it exists and it is older than `orphan_age_s` (a trainer's in-loop export
whose request may still be spooled). Everything goes
through `Staging.retire`, which is confined to the staging root; `hf` sources are never touched.
A staging root refused as unsafe (a symlink, another user's, writable by others without the
sticky bit: `UnsafeStagingRootError`) is swept not at all: the janitor logs it, lists it in
`refused`, and goes on with the other roots; a stuck point on it is still crashed and recorded.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import cast
from uuid import UUID

from prefect import flow, get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.responses import OrchestrationResult, SetStateStatus
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
from prefect.states import Crashed
from pydantic import BaseModel, Field

from blocks import SinksBlock, StagingBlock
from flows.point_runs import step_point_flow_runs
from pinned_eval.inflight import POINT_FLOW, in_flight
from pinned_eval.points import SnapshotSource, flow_run_name
from pinned_eval.snapshot.staging import StagingPathError
from tasks.outcome import keep_best_protection, record_failed, retire_owned

HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"
_PAGE = 200


class StuckPoint(BaseModel):
    flow_run_id: str
    name: str
    run: str
    step: int
    state: str
    last_activity: datetime
    quiet_seconds: float


class JanitorReport(BaseModel):
    crashed: list[StuckPoint] = Field(default_factory=list, description="Points forced to Crashed.")
    retired: list[str] = Field(default_factory=list, description="Snapshots retired (entered the keep-ring).")
    kept_live: list[str] = Field(default_factory=list, description="Unretired snapshots of live points.")
    refused: list[str] = Field(default_factory=list, description="Staging roots or paths refused as unsafe (why).")


def last_activity(client: SyncPrefectClient, fr: FlowRun) -> datetime:
    """Newest of: the run's state timestamp, its task runs' state timestamps, its heartbeats."""

    seen: list[datetime | None] = [fr.state.timestamp if fr.state else fr.created]
    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
    seen += [t.state.timestamp for t in tasks if t.state]
    since = fr.start_time or fr.created or (datetime.now(UTC) - timedelta(days=1))
    page = client.read_events(
        EventFilter(
            occurred=EventOccurredFilter.model_validate(
                {"since": since, "until": datetime.now(UTC) + timedelta(minutes=1)}
            ),
            event=EventNameFilter(name=[HEARTBEAT_EVENT]),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{fr.id}"]),
        ),
        limit=1,
    )
    seen += [e.occurred for e in page.events]
    return max(s for s in seen if s is not None)


def _stuck_candidates(client: SyncPrefectClient, run: str | None) -> list[FlowRun]:
    tags = FlowRunFilterTags(all_=[f"run:{run}"]) if run else None
    # Pending too: a worker that died between submitting and starting the run leaves it Pending.
    state = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]))
    runs: list[FlowRun] = []
    while True:  # what is running or pending, in pages (the server's default limit would cut it at 200)
        page = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[POINT_FLOW])),
            flow_run_filter=FlowRunFilter(state=state, tags=tags),
            limit=_PAGE, offset=len(runs),
        )  # fmt: skip
        runs += page
        if len(page) < _PAGE:
            return [r for r in runs if "run" in r.parameters and "step" in r.parameters]


def _protect(staging: StagingBlock, run: str, sinks: str) -> frozenset[int] | None:
    """The best-K steps a retire of `run` keeps (None without keep_best), ranked from the ledger
    of sinks block `sinks`; None too (the retire deletes nothing) when keep_best cannot rank
    them (no such block, no ledger), logged."""
    if not staging.keep_best:
        return None
    try:
        jsonl_path = cast(SinksBlock, SinksBlock.load(sinks)).jsonl_path
    except ValueError as exc:
        get_run_logger().error("janitor: %s: nothing of run %s deleted", exc, run)
        return None
    return keep_best_protection(staging, run, jsonl_path, lenient=True)


@task(cache_policy=NO_CACHE, task_run_name="crash-{point.name}")
def crash_point(point: StuckPoint, window_s: float) -> list[str] | None:
    """Set the stuck run Crashed and record it (`tasks.outcome.record_failed`: emit `failed`,
    retire its owned snapshot (returned), then `skipped_crashed` in the ledger and the exporters);
    None, and nothing done, when the server refuses the transition (the run ended meanwhile)."""

    logger = get_run_logger()
    message = (
        f"janitor: no activity for {point.quiet_seconds:.0f}s (window {window_s:.0f}s, last "
        f"{point.last_activity.isoformat()}); the flow-run process or its host is gone"
    )
    with get_client(sync_client=True) as client:
        fr = client.read_flow_run(UUID(point.flow_run_id))
        result: OrchestrationResult[None] = client.set_flow_run_state(point.flow_run_id, Crashed(message=message))
    if result.status is not SetStateStatus.ACCEPT:
        logger.info("%s ended meanwhile (%s: %s); not crashed", point.name, result.status.value, result.details)
        return None
    params = fr.parameters
    source = SnapshotSource.model_validate(params["source"]) if params.get("source") else None
    retired: list[str] = []

    def retire(sinks: SinksBlock) -> None:
        if source is None or not source.owned:
            return
        try:  # an unsafe root or path is refused; the point is still recorded as crashed
            block = cast(StagingBlock, StagingBlock.load(params.get("staging", "default")))
            done = retire_owned(
                block, sinks.jsonl_path, point.run, point.step, source=source, as_task=False, lenient=True
            )
            retired.extend([done.path] if done is not None else [])
        except StagingPathError as exc:
            logger.error("janitor: snapshot of %s not retired: %s", point.name, exc)

    def load_sinks() -> SinksBlock:
        return cast(SinksBlock, SinksBlock.load(params.get("sinks", "default")))

    record_failed(point.run, point.step, message, load_sinks, flow_run_id=point.flow_run_id, retire=retire)
    logger.warning("crashed %s (%s): %s", point.name, point.flow_run_id, message)
    return retired


@task(cache_policy=NO_CACHE, task_run_name="sweep-{staging_name}")
def sweep_staging(staging_name: str, run: str | None, orphan_age_s: float, live: set[tuple[str, int]]) -> JanitorReport:
    """Retire unretired snapshots whose points are all terminal (or long orphaned)."""
    logger = get_run_logger()
    report = JanitorReport()
    try:
        block = cast(StagingBlock, StagingBlock.load(staging_name))
        staging = block.staging()
    except StagingPathError as exc:  # UnsafeStagingRootError: never swept
        logger.error("janitor: staging %r not swept: %s", staging_name, exc)
        report.refused.append(f"{staging_name}: {exc}")
        return report
    now = datetime.now(UTC).timestamp()
    protect_cache: dict[tuple[str, str], frozenset[int] | None] = {}  # one ledger ranking per (run, sinks)
    snaps = [snap for snap in staging.list(run) if not snap.retired]
    by_run: dict[str, dict[int, list[FlowRun]]] = {}
    with get_client(sync_client=True) as client:
        # the flow runs of the unretired snapshots' steps only, never a run's whole history
        for r in sorted({snap.run for snap in snaps}):
            by_step: dict[int, list[FlowRun]] = {}
            for fr in step_point_flow_runs(client, r, {snap.step for snap in snaps if snap.run == r}):
                by_step.setdefault(int(fr.parameters["step"]), []).append(fr)
            by_run[r] = by_step
        for snap in snaps:
            runs = by_run[snap.run].get(snap.step, [])
            live_run = any(in_flight(r.state.type.value if r.state else None) for r in runs)
            if (snap.run, snap.step) in live or live_run:
                report.kept_live.append(snap.path)
                continue
            if not runs and now - snap.mtime < orphan_age_s:
                report.kept_live.append(snap.path)  # its request may still be on its way
                continue
            key = (snap.run, _sinks_of(runs))
            if key not in protect_cache:
                protect_cache[key] = _protect(block, *key)
            staging.retire(snap.path, owned=True, protect=protect_cache[key])
            report.retired.append(snap.path)
            logger.info("retired orphaned snapshot %s (%s)", snap.path, "no point" if not runs else "points ended")
    return report


def _sinks_of(runs: list[FlowRun]) -> str:
    """The sinks block the step's newest point named (`default` when no flow run names one)."""
    newest = max(runs, key=lambda r: r.created.timestamp() if r.created else 0.0, default=None)
    return str(newest.parameters.get("sinks", "default")) if newest else "default"


@flow(name="janitor", flow_run_name="janitor")
def janitor(
    heartbeat_window_s: float = 600.0,
    run: str | None = None,
    orphan_age_s: float = 86400.0,
    staging: list[str] | None = None,
) -> JanitorReport:
    """Crash eval points quiet for longer than `heartbeat_window_s`; retire orphaned staged snapshots."""
    if heartbeat_window_s <= 0:
        raise ValueError(f"heartbeat_window_s: must be > 0, got {heartbeat_window_s}")
    if orphan_age_s < 0:
        raise ValueError(f"orphan_age_s: must be >= 0, got {orphan_age_s}")
    logger = get_run_logger()
    now = datetime.now(UTC)
    stuck: list[StuckPoint] = []
    live: set[tuple[str, int]] = set()
    staging_names = set(staging or ["default"])
    with get_client(sync_client=True) as client:
        for fr in _stuck_candidates(client, run):
            r, step = str(fr.parameters["run"]), int(fr.parameters["step"])
            staging_names.add(str(fr.parameters.get("staging", "default")))
            seen = last_activity(client, fr)
            quiet = (now - seen).total_seconds()
            if quiet <= heartbeat_window_s:
                live.add((r, step))
                continue
            state = (fr.state.name or fr.state.type.value) if fr.state else "Pending"
            stuck.append(
                StuckPoint(
                    flow_run_id=str(fr.id),
                    name=fr.name or flow_run_name(r, step),
                    run=r,
                    step=step,
                    state=state,
                    last_activity=seen,
                    quiet_seconds=quiet,
                )
            )
    report = JanitorReport()
    for point in stuck:
        retired = crash_point(point, heartbeat_window_s)
        if retired is not None:
            report.crashed.append(point)
            report.retired += retired
    for name in sorted(staging_names):
        try:
            StagingBlock.load(name)
        except ValueError:
            logger.info("no staging block %r; nothing to sweep there", name)
            continue
        swept = sweep_staging(name, run, orphan_age_s, live)
        report.retired += swept.retired
        report.kept_live += swept.kept_live
        report.refused += swept.refused
    logger.info("janitor: crashed %d point(s), retired %d snapshot(s)", len(report.crashed), len(report.retired))
    return report
