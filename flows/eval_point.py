"""The eval-point flow: one Prefect flow run measures one verified weight version, or says why not.

    validate → load blocks → due → admit → load datasets → export → check → measure → record;
    finally: retire
    (measure by posture, `tasks.measure.MEASURES`: fleet [fleet lock: pin → generate] → score;
    shared [fleet lock: verify → generate] → score; external [backend lock: the backend's
    evaluate_checkpoint]; record: `tasks.outcome`)

Outcomes: Completed (measured); Completed named "Skipped" with the reason as message (an
`EvalSkipped` anywhere: busy, export_failed, ckpt_missing, unhealthy, pin_violation,
reward_unavailable, ...; `timed_out` once admitted past the suite block's `point_timeout_seconds`);
Failed on an unexpected error, after recording `skipped_crashed` at the step — also a source
outside the staging block's source roots (`SourceOutsideRoots`, naming `source.path` or
`source.hf_base` and the roots), refused before any file of it is opened; its state message and
failed event are that message alone. The snapshot is
retired on every outcome (keep-ring for owned snapshots, untouched otherwise), and by the
`on_crashed` hook when the flow-run process itself is killed.
A point measures the suite's datasets due at its step (`every_n_steps`; all at the final point)
and its `eval.delegate` services at every point, as miles runs them at every eval: a step with no
dataset due measures the delegates alone, one with neither is skipped `no_dataset_due`
(`due_suite`). Each outcome emits its `pinned-eval.point.*` event (`tasks.alerts`: measured,
regressed, skipped, failed).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Literal

from prefect import flow, get_client
from prefect.client.schemas.objects import FlowRun
from prefect.runtime import flow_run as current
from prefect.states import Failed, State
from prefect.utilities.timeout import timeout

from blocks import EvalSuiteBlock, ExternalBackendBlock, FleetBlock, SinksBlock, StagingBlock
from blocks._meta import load_block
from pinned_eval.points import PointRequest, Posture, SnapshotSource
from pinned_eval.prometheus import InFlight
from pinned_eval.skips import EvalSkipped, SkipReason
from pinned_eval.snapshot.staging import Staging
from pinned_eval.source_roots import SourceOutsideRoots, confine_source
from pinned_eval.suite import NO_DATASET_DUE, EvalSuite
from tasks.admission import admitted
from tasks.generate import load_datasets
from tasks.measure import MEASURES, MeasureInput, PointConfig
from tasks.outcome import record_failed, record_measured, record_skipped, retire_owned
from tasks.skip_logging import quiet_expected_skips
from tasks.snapshots import Snapshot, check_snapshot_task, export_snapshot

__all__ = ["PointConfig", "due_suite", "eval_point", "point_deadline", "retire_on_crash"]


def retire_on_crash(flow: object, flow_run: FlowRun, state: State) -> None:
    """`on_crashed` hook (runs in the worker when the flow-run process dies): alert, retire, record.

    It emits the run's one `pinned-eval.point.failed` (see `tasks.alerts`), first, so the alert
    goes out even when retiring or recording fails; the record is the ledger row only (no flow
    run to export from)."""
    params = flow_run.parameters
    run, step = params["run"], int(params["step"])
    source = SnapshotSource.model_validate(params["source"]) if params.get("source") else None

    def retire(sinks: SinksBlock) -> None:
        if source is not None and source.owned:
            staging = load_block(StagingBlock, params.get("staging", "default"))
            retire_owned(staging, sinks.jsonl_path, run, step, source=source, as_task=False)

    began = flow_run.start_time
    record_failed(
        run,
        step,
        state.message or "crashed",
        lambda: load_block(SinksBlock, params.get("sinks", "default")),
        flow_run_id=str(flow_run.id),
        export=False,
        retire=retire,
        seconds=(datetime.now(UTC) - began).total_seconds() if began else None,
    )


@flow(name="eval-point", flow_run_name="{run}/step-{step}", on_crashed=[retire_on_crash])
def eval_point(
    run: str,
    step: int,
    source: SnapshotSource | None = None,
    final: bool = False,
    posture: Posture = Posture.FLEET,
    policy: Literal["backpressure", "skip"] = "backpressure",
    max_in_flight: int = 2,
    export_time_seconds: float | None = None,
    suite: str = "default",
    fleet: str = "default",
    staging: str = "default",
    sinks: str = "default",
    backend_block: str | None = None,
) -> State:
    """Measure the weights of `run` at `step` (weight version `str(step)`) on the eval suite.

    `backend_block`: the external posture's saved `ExternalBackendBlock` (class path and options
    set by an operator); parameters name blocks and a source, never code. The source must lie
    under the staging block's `all_source_roots()`.
    """
    PointRequest(  # validates every parameter, naming the offending field, before anything runs
        run=run,
        step=step,
        source=source,
        final=final,
        posture=posture,
        policy=policy,
        max_in_flight=max_in_flight,
        export_time_seconds=export_time_seconds,
        backend_block=backend_block,
    )
    quiet_expected_skips()  # a task's EvalSkipped: INFO, no traceback (the WARNING names it)
    started = time.monotonic()
    in_flight = InFlight(run).start()  # the worker's `pinned_eval_points_in_flight` (docs/metrics.md)
    sinks_block: SinksBlock | None = None
    staging_block: StagingBlock | None = None
    store: Staging | None = None
    snapshot: Snapshot | None = None
    try:  # setup too: a failure from here on is recorded at the step and the snapshot retired
        sinks_block = load_block(SinksBlock, sinks)  # sinks and staging first: what fails next is recorded
        staging_block = load_block(StagingBlock, staging)
        store = staging_block.staging()
        _confine_and_tag(source, staging_block, run, step)
        cfg = _load_point_blocks(sinks_block, staging_block, suite, fleet, posture, backend_block)
        cfg, not_due = _due_only(cfg, step, final)  # cadence: the datasets due at this step (all when final)
        with admitted(run, step, policy=policy, final=final, max_in_flight=max_in_flight):
            with point_deadline(cfg.suite.point_timeout_seconds, step):
                datasets = cfg.suite.resolved()
                rows = load_datasets(datasets)
                snapshot = _export(posture, source, run, step, store, cfg)  # None in the shared posture
                snapshot = check_snapshot_task(snapshot, store, cfg.staging.s3_options()) if snapshot else None
                measured = MEASURES[posture](cfg, MeasureInput(run, step, snapshot, datasets, rows))
            exported = snapshot.export_time_seconds if snapshot else None
            return record_measured(
                run,
                step,
                measured,
                not_due,
                cfg.suite,
                cfg.sinks,
                started=started,
                export_time_seconds=exported or export_time_seconds,
            )
    except EvalSkipped as skip:
        return record_skipped(run, step, skip, sinks_block, started=started)
    except SourceOutsideRoots as exc:  # the request's fault: failed, in the message's own words (no class name)
        record_failed(run, step, str(exc), sinks_block, seconds=time.monotonic() - started)
        return Failed(message=str(exc))
    except Exception as exc:
        record_failed(run, step, repr(exc), sinks_block, seconds=time.monotonic() - started)
        raise
    finally:
        in_flight.end()
        if store is not None and staging_block is not None and sinks_block is not None:
            retire_owned(
                staging_block, sinks_block.jsonl_path, run, step, snapshot=snapshot, source=source, store=store
            )


def _confine_and_tag(source: SnapshotSource | None, staging: StagingBlock, run: str, step: int) -> None:
    """The source confined to the staging block's roots before anything opens it (a refused source
    is never read); then the flow run tagged."""
    if source is not None:
        confine_source(source, staging.all_source_roots())
    _tag_flow_run(run, step)


def _load_point_blocks(
    sinks: SinksBlock, staging: StagingBlock, suite: str, fleet: str, posture: Posture, backend_block: str | None
) -> PointConfig:
    backend = load_block(ExternalBackendBlock, backend_block) if posture is Posture.EXTERNAL and backend_block else None
    return PointConfig(
        suite=load_block(EvalSuiteBlock, suite),
        fleet=load_block(FleetBlock, fleet),
        staging=staging,
        sinks=sinks,
        backend=backend,
    )


class _PastDeadline(TimeoutError):
    pass


@contextmanager
def point_deadline(seconds: float, step: int) -> Iterator[None]:
    """Raise `EvalSkipped(TIMED_OUT)` when the body runs past `seconds`.

    Prefect's cancel scope: SIGALRM in the main thread (a flow-run process), else an exception
    injected into this thread (delivered at its next Python instruction). Either unwinds through
    the fleet lock and the admission slot, which release on exit, and the flow's `finally` retires
    the snapshot.
    """
    try:
        with timeout(seconds, timeout_exc_type=_PastDeadline):
            yield
    except _PastDeadline as exc:
        raise EvalSkipped(SkipReason.TIMED_OUT, f"step {step}: still running after {seconds:g}s") from exc


def _export(
    posture: Posture, source: SnapshotSource | None, run: str, step: int, store: Staging, cfg: PointConfig
) -> Snapshot | None:
    """The point's snapshot, exported (or adopted); None in the shared posture."""
    if posture is Posture.SHARED:
        return None
    if source is None:  # PointRequest refuses it first: the fleet and external postures need a source
        raise ValueError(f"source: the {posture.value} posture needs one")
    return export_snapshot(source, run, step, store, cfg.fleet.lora_mode)


def due_suite(suite: EvalSuite, step: int, final: bool) -> tuple[EvalSuite, list[str]]:
    """The suite a point at `step` measures, and the names of the datasets not due: the datasets due
    (`EvalSuite.due_at`) with every delegate, since miles runs `eval.delegate` at every eval; with no
    dataset due, the delegates alone (a suite of no dataset: the point pins the fleet for them and
    records their metrics on one point-level row); with no dataset due and no delegate,
    `EvalSkipped(no_dataset_due)` (before any export or fleet work)."""
    due = suite.due_at(step, final=final)
    if due is None and not suite.delegates:
        raise EvalSkipped(NO_DATASET_DUE, f"step {step}: no dataset is due (every_n_steps)")
    if due is None:  # model_copy does not validate: the one place a suite holds no dataset
        due = suite.model_copy(update={"datasets": ()})
    return due, [ds.name for ds in suite.datasets if ds not in due.datasets]


def _due_only(cfg: PointConfig, step: int, final: bool) -> tuple[PointConfig, list[str]]:
    """`cfg` with its suite cut to what is due at `step` (`due_suite`), and the datasets not due."""
    due, not_due = due_suite(cfg.suite.suite, step, final)
    return cfg.model_copy(update={"suite": cfg.suite.model_copy(update={"suite": due})}), not_due


def _tag_flow_run(run: str, step: int) -> None:
    """Tag this run `run:<run>`, `step:<step>` (triggered runs start with the deployment's tags only)."""

    with get_client(sync_client=True) as client:
        tags = sorted({*current.tags, f"run:{run}", f"step:{step}"})
        client.update_flow_run(current.id, tags=tags)
