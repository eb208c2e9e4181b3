"""The eval-point flow: one Prefect flow run measures one verified weight version, or says why not.

    admit → export → check → [fleet lock: pin → generate] → score → log;  finally: retire
    (external posture: [backend lock: the backend's evaluate_checkpoint] in place of the bracket)

Outcomes: Completed (measured); Completed named "Skipped" with the reason as message (an
`EvalSkipped` anywhere: busy, export_failed, ckpt_missing, unhealthy, pin_violation,
reward_unavailable, ...; `timed_out` once admitted past the suite block's `point_timeout_seconds`);
Failed on an unexpected error, after recording `skipped_crashed` at the step — also a source
outside the staging block's source roots (`SourceOutsideRoots`, naming `source.path` or
`source.hf_base`), refused before any file of it is opened. The snapshot is
retired on every outcome (keep-ring for owned snapshots, untouched otherwise), and by the
`on_crashed` hook when the flow-run process itself is killed.
A point measures the suite's datasets due at its step (`every_n_steps`; all at the final point;
none due: skipped `no_dataset_due`), and each outcome emits its `pinned-eval.point.*` event
(`flows.alerts`: measured, regressed, skipped, failed).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from prefect import flow, get_client, get_run_logger
from prefect.client.schemas.objects import FlowRun
from prefect.runtime import flow_run as current
from prefect.states import Completed, State
from prefect.utilities.timeout import timeout
from pydantic import BaseModel, ConfigDict

from blocks import EvalSuiteBlock, ExternalBackendBlock, FleetBlock, SinksBlock, StagingBlock
from blocks._meta import load_block
from flows.alerts import emit_failed, emit_measured, emit_skipped
from pinned_eval.datasets.loader import EvalSample
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.points import PointRequest, Posture, SnapshotSource, flow_run_name
from pinned_eval.results.cache import generation_key, snapshot_digest
from pinned_eval.scoring.metrics import point_metrics
from pinned_eval.sinks import JsonlSink
from pinned_eval.skips import EvalSkipped, SkipReason
from pinned_eval.snapshot.staging import Staging
from pinned_eval.source_roots import confine_source
from pinned_eval.suite import NO_DATASET_DUE
from tasks.admission import admitted, pin_lock
from tasks.external import backend_lock_name, evaluate_external
from tasks.generate import generate, load_datasets
from tasks.log import lag_steps, log_point, measured_rows, sink_note, skip_rows
from tasks.pin import pin_fleet, verify_shared
from tasks.results import cached_generations, store_generations
from tasks.score import score
from tasks.skip_logging import quiet_expected_skips
from tasks.snapshots import Snapshot, check_snapshot_task, export_snapshot, retire_snapshot


class PointConfig(BaseModel):
    """The blocks a point uses, loaded once at flow start (sinks and staging first, so a failure
    loading the others is still recorded and the snapshot still retired)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    suite: EvalSuiteBlock
    fleet: FleetBlock
    staging: StagingBlock
    sinks: SinksBlock
    backend: ExternalBackendBlock | None = None  # the external posture's, named by `backend_block`


def retire_on_crash(flow: object, flow_run: FlowRun, state: State) -> None:
    """`on_crashed` hook (runs in the worker when the flow-run process dies): alert, retire, record.

    It emits the run's one `pinned-eval.point.failed` (see `flows.alerts`), first, so the alert
    goes out even when retiring or recording fails."""
    params = flow_run.parameters
    run, step = params["run"], int(params["step"])
    emit_failed(run, step, state.message or "crashed", flow_run_id=str(flow_run.id))
    source = SnapshotSource.model_validate(params["source"]) if params.get("source") else None
    sinks = load_block(SinksBlock, params.get("sinks", "default"))
    if source is not None and source.owned:
        staging_block = load_block(StagingBlock, params.get("staging", "default"))
        staging = staging_block.staging()
        protect = staging_block.protected_steps(run, sinks.jsonl_path)  # best K by a metric
        staging.retire(staging.path_for(run, step), owned=True, protect=protect)

    if sinks.jsonl_path:
        JsonlSink(sinks.jsonl_path).write_point(
            skip_rows(run, step, SkipReason.CRASHED, state.message or "crashed", failed=True)
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
        run=run, step=step, source=source, final=final, posture=posture, policy=policy,
        max_in_flight=max_in_flight, export_time_seconds=export_time_seconds,
        backend_block=backend_block,
    )  # fmt: skip
    quiet_expected_skips()  # a task's EvalSkipped: INFO, no traceback (the WARNING below names it)
    started = time.monotonic()
    sinks_block: SinksBlock | None = None
    store: Staging | None = None
    snapshot: Snapshot | None = None
    try:  # setup too: a failure from here on is recorded at the step and the snapshot retired
        sinks_block = load_block(SinksBlock, sinks)
        staging_block = load_block(StagingBlock, staging)
        store = staging_block.staging()
        if source is not None:  # before anything opens it: a refused source is never read
            confine_source(source, staging_block.all_source_roots())
        _tag_flow_run(run, step)
        cfg = PointConfig(
            suite=load_block(EvalSuiteBlock, suite), fleet=load_block(FleetBlock, fleet),
            staging=staging_block, sinks=sinks_block,
            backend=load_block(ExternalBackendBlock, backend_block)
            if posture is Posture.EXTERNAL and backend_block else None,
        )  # fmt: skip
        cfg, not_due = _due_only(cfg, step, final)  # cadence: the datasets due at this step (all when final)
        with admitted(run, step, policy=policy, final=final, max_in_flight=max_in_flight):
            with point_deadline(cfg.suite.point_timeout_seconds, step):
                datasets = cfg.suite.resolved()
                rows = load_datasets(datasets)
                if posture is not Posture.SHARED:
                    assert source is not None
                    snapshot = export_snapshot(source, run, step, store, cfg.fleet.lora_mode)
                    snapshot = check_snapshot_task(snapshot, store, cfg.staging.s3_options())
                per_dataset = _measure(cfg, posture, snapshot, datasets, rows, run, step)
            exported = snapshot.export_time_seconds if snapshot else None
            point = point_metrics(
                step, lag_steps(run, step), time.monotonic() - started, exported or export_time_seconds
            )
            point.update({"eval/datasets_run": float(len(per_dataset)), "eval/datasets_not_due": float(len(not_due))})
            sink_errors = log_point(run, step, measured_rows(run, step, per_dataset, point), cfg.sinks)
            regressed = emit_measured(run, step, per_dataset, cfg.suite.regression, cfg.sinks.jsonl_path)
            summary = ", ".join(f"{ds}={m[f'eval/{ds}']:.3f}" for ds, m in per_dataset.items())
            summary += f" (not due: {', '.join(not_due)})" if not_due else ""
            summary += f"; regressed: {', '.join(r.dataset for r in regressed)}" if regressed else ""
            return Completed(message=f"measured {flow_run_name(run, step)}: {summary}{sink_note(sink_errors)}")
    except EvalSkipped as skip:
        get_run_logger().warning("skipped %s: %s", flow_run_name(run, step), skip)
        sink_errors = {}
        if sinks_block is not None:
            sink_errors = log_point(run, step, skip_rows(run, step, skip.reason, skip.message), sinks_block)
        emit_skipped(run, step, skip.reason, skip.message)
        return Completed(name="Skipped", message=f"{skip.reason}: {skip.message}{sink_note(sink_errors)}")
    except Exception as exc:
        if sinks_block is not None:  # else the sinks block itself failed to load: nowhere to record
            log_point(run, step, skip_rows(run, step, SkipReason.CRASHED, repr(exc), failed=True), sinks_block)
        emit_failed(run, step, repr(exc))
        raise
    finally:
        if store is not None:
            snapshot = snapshot or _owned_but_not_adopted(source, store, run, step)
            if snapshot is not None:
                assert sinks_block is not None  # loaded before the store
                protect = staging_block.protected_steps(run, sinks_block.jsonl_path)  # best K by a metric
                retire_snapshot(snapshot, store, protect)


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


def _measure(
    cfg: PointConfig,
    posture: Posture,
    snapshot: Snapshot | None,
    datasets: list[ResolvedDataset],
    rows: dict[str, list[EvalSample]],
    run: str,
    step: int,
) -> dict[str, dict[str, float]]:
    """Metrics per dataset of weight version `str(step)`: fleet (pin), shared (verify) or external.

    With a results store (fleet posture), generations stored under this point's cache key are
    reused — no pin, no request — and only scored; fresh ones are stored before scoring."""
    version = str(step)
    if posture is Posture.EXTERNAL:
        assert snapshot is not None and cfg.backend is not None  # PointRequest: external needs backend_block
        backend, options = cfg.backend.configuration()
        with pin_lock(backend_lock_name(backend, options)):
            return evaluate_external(backend, str(snapshot.local_path), run, step, cfg.suite.suite, options)
    lora = version if snapshot is not None and snapshot.adapter else None  # adapter mode: name it everywhere
    # chat templates come from the pinned snapshot's tokenizer (a LoRA adapter: its base's);
    # shared: the engines' model
    tokenizer_dir = cfg.fleet.model_path if snapshot is None else snapshot.lora_base or str(snapshot.local_path)
    results = cfg.sinks.results_store()
    key = None  # generation cache (tasks/results.py): fleet posture only, keyed by the snapshot's digest
    if results is not None and posture is Posture.FLEET and snapshot is not None:
        key = generation_key(snapshot_digest(str(snapshot.local_path)), version, datasets, rows, tokenizer_dir,
                             snapshot.lora_base)  # fmt: skip
    generations = cached_generations(results, run, step, key) if results is not None and key else None
    if generations is None:
        with pin_lock(cfg.fleet.lock_name):
            if posture is Posture.FLEET:
                assert snapshot is not None
                pin_fleet(cfg.fleet, str(snapshot.local_path), version, snapshot.lora_base)
            else:
                verify_shared(cfg.fleet, version)
            generations = generate(
                cfg.fleet, datasets, rows, version, rid_prefix=f"{run}-{step}", tokenizer_dir=tokenizer_dir,
                lora_path=lora,
            )  # fmt: skip
        if results is not None and key:
            store_generations(results, run, step, key, generations)
    return score(generations, datasets, cfg.suite.suite, run, step, results, key)


def _due_only(cfg: PointConfig, step: int, final: bool) -> tuple[PointConfig, list[str]]:
    """`cfg` with its suite cut to the datasets due at `step`, and the names of those not due;
    `EvalSkipped(no_dataset_due)` when none is (before any export or fleet work)."""
    suite = cfg.suite.suite
    due = suite.due_at(step, final=final)
    if due is None:
        raise EvalSkipped(NO_DATASET_DUE, f"step {step}: no dataset is due (every_n_steps)")
    not_due = [ds.name for ds in suite.datasets if ds not in due.datasets]
    return cfg.model_copy(update={"suite": cfg.suite.model_copy(update={"suite": due})}), not_due


def _owned_but_not_adopted(source: SnapshotSource | None, store: Staging, run: str, step: int) -> Snapshot | None:
    """An owned source is this point's from the start: a point that fails before its export task
    (busy, a bad dataset row) still retires the staged snapshot the trainer handed over."""
    if source is None or not source.owned:
        return None
    return Snapshot(path=store.path_for(run, step), owned=True, kind=source.kind)


def _tag_flow_run(run: str, step: int) -> None:
    """Tag this run `run:<run>`, `step:<step>` (triggered runs start with the deployment's tags only)."""

    with get_client(sync_client=True) as client:
        tags = sorted({*current.tags, f"run:{run}", f"step:{step}"})
        client.update_flow_run(current.id, tags=tags)
