"""`EvalClient`: the training loop's dispatcher of eval points (no Prefect import).

Contract:
- `dispatch(step, source=None, final=False, export=None)` admits the point *before* any in-loop
  export, from local state only (never a network call on the caller's thread): the run's
  non-terminal eval-point flow runs as last read by the admission thread, plus the points this
  client requested that are not visible there yet (spooled, or sent and awaiting their run),
  deduplicated by step. The admission thread (`trainer_integration.admission_sync`) re-reads the
  server every `poll_s` while points are in flight (`idle_sync_s` otherwise), so the server stays
  the source of truth, also after a restart of either side; the constructor waits up to
  `startup_sync_s` for its first answer (or failure), so a restarted trainer's first dispatch
  already counts its points in flight.
  At `max_in_flight`: `skip` (never for the final point) records `busy` at the step without
  exporting; `backpressure` waits for the thread to see a slot free. While that view is not
  fresh (no answer yet, or the last query failed) the point is admitted (`admitted_offline`;
  the flow's own global concurrency limit still bounds it) and spooled.
- an in-loop export (`export(step, dest)`) writes into `<staging_root>/<run>/step_<step:08d>`,
  is timed as `export_time_seconds`; any exception the exporter raises (a storage or converter
  failure, `pinned_eval.snapshot.errors.EXPORT_ERRORS`, or the exporter's own error, e.g. a
  `ValueError`) removes the partial output, is logged at ERROR with its traceback and recorded as
  `export_failed` at the step; `dispatch` returns `skipped_export_failed` with the exception in
  `reason`, and the next dispatch exports again. An `s3://` staging root uses `storage_options`, else the saved
  staging block's endpoint and credentials (fetched once, by name, over the API).
  That is the contract of a plain `export(step, dest)` callable: it runs to completion inside
  `dispatch`. A two-phase exporter (`pinned_eval.snapshot.two_phase`: `StateDictExport`,
  `LoraExport`; a pre-staged collective `pinned_eval.snapshot.collective_staged.StagedCollective`)
  only stalls the loop for the copy of the step's tensors into the client's reusable host buffer
  (`host_staging`, one snapshot's worth; pinned with CUDA): `dispatch` returns `exporting` once
  the copy is done, the snapshot is written in the background (`trainer_integration.background_export`)
  and the point is requested only after its `.complete` marker exists. While the previous
  snapshot is still being written, a new two-phase export waits for it (`backpressure`, and the
  final point) or is skipped as `export_busy` (`skip`) — never a second buffer. A failed
  background write is that step's `export_failed`, its partial output removed.
- every request is written ahead to the durable spool and sent by a background thread (the run
  created directly on the deployment, the event as fallback: `trainer_integration.events`), so a
  non-waiting call costs the loop one fsync. `dispatch` never raises into training for anything
  the point does (the exporter, storage, the API): those are logged and become skip records (a
  spool that cannot be written, e.g. a full disk, returns `skipped_spool_failed` with the reason,
  naming the skip that could not be recorded, `busy` or `export_failed` and why; a storage or API
  error whose record cannot be spooled is `skipped_export_failed` with both errors in `reason`).
  It raises `ValueError` only for a misuse of the call itself, found before anything is exported:
  a negative step, a fleet point with neither a source nor an exporter, an in-loop export without
  `staging_root`, an S3 `staging_root` whose saved staging block does not exist.
  A step already requested or recorded is not requested again.
- `report_progress(step)` publishes the trainer's step in the Variable the flow reads for
  `eval/lag_steps` (latest value wins, sent in the background).
- `drain(timeout)`, `results()`, `best(metric)`, `wait_for(step)`: outcomes, read over REST and
  from the JSONL sink file (`trainer_integration.outcomes`; network and file I/O: call them
  between training steps or at the end, never per step — `dispatch` never does).
- `evaluate_now(step, gate)` (shared posture): closes the producer gate, requests a
  `posture="shared"` point, waits for it, and reopens the gate in `finally`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx

from pinned_eval.events import BlockNames
from pinned_eval.points import PointRequest, Posture, SnapshotSource, run_key
from pinned_eval.settings import PrefectApiSettings, get_settings
from pinned_eval.snapshot.confined import UnsafeStagingRootError
from pinned_eval.snapshot.errors import EXPORT_ERRORS
from pinned_eval.snapshot.host_staging import HostStaging, Staged, TwoPhaseExport
from trainer_integration.admission import AdmissionView
from trainer_integration.admission_sync import AdmissionSync
from trainer_integration.background_export import BackgroundWrites
from trainer_integration.events import (
    Delivery,
    event_entry,
    skip_record_entry,
)
from trainer_integration.export_target import ExportTarget
from trainer_integration.outcomes import PointOutcomes
from trainer_integration.progress import ProgressPublisher
from trainer_integration.rest import ApiUnavailableError, PrefectRest, api_client
from trainer_integration.results import DispatchResult, PointOutcome
from trainer_integration.spool import Deliverer, Spool, SpoolEntry, SpoolWriteError
from trainer_integration.two_phase_dispatch import TwoPhaseDispatch

log = logging.getLogger(__name__)

Exporter = Callable[[int, str], object] | TwoPhaseExport | Staged
# what `dispatch` turns into an `export_failed` record instead of raising into the training loop
# (an unsafe staging root, e.g. a symlink another user planted, is refused and skipped, not raised)
_INFRA_ERRORS: tuple[type[BaseException], ...] = (
    *EXPORT_ERRORS, ApiUnavailableError, httpx.HTTPError, UnsafeStagingRootError,
)


class GateLike(Protocol):
    """What `evaluate_now` needs of a producer gate (`trainer_integration.gate.ProducerGate`)."""

    def closed(self, reason: str = "") -> AbstractAsyncContextManager[object]: ...


class EvalClient(TwoPhaseDispatch, PointOutcomes):
    def __init__(
        self,
        run: str,
        api_url: str | None = None,
        *,
        blocks: BlockNames | None = None,
        policy: Literal["backpressure", "skip"] = "backpressure",
        max_in_flight: int = 2,
        staging_root: str | Path | None = None,
        exporter: Exporter | None = None,
        eval_interval: int | None = None,
        spool_dir: str | Path | None = None,
        webhook_url: str | None = None,
        deployment: str = "eval-point/eval-point",
        settings: PrefectApiSettings | None = None,
        http: httpx.Client | None = None,
        poll_s: float = 0.5,
        idle_sync_s: float = 5.0,
        startup_sync_s: float = 10.0,
        visible_timeout_s: float = 120.0,
        direct_runs: bool | None = None,
        backend_block: str | None = None,
        lora_base: str | Path | None = None,
        storage_options: dict[str, Any] | None = None,
        host_staging: HostStaging | None = None,
    ) -> None:
        """`lora_base`: in-loop exports write a PEFT LoRA adapter (e.g. `write_adapter_snapshot(peft_model,
        dest)`) for this base HF dir, so they are dispatched as `lora` sources (the fleet block's
        `lora_mode` serves them as an adapter or merged). `host_staging`: the host buffer two-phase
        exports stage into (default: one `HostStaging()`, pinned when CUDA is available)."""
        settings = settings or PrefectApiSettings()
        webhook_url = webhook_url or settings.webhook_url
        url = api_url or settings.api_url
        if not url:
            raise ValueError("api_url: pass it or set PREFECT_API_URL")
        # validated once here, so a bad run name fails at construction, not in the loop
        PointRequest(run=run, step=0, posture=Posture.SHARED, policy=policy, max_in_flight=max_in_flight)
        if eval_interval is not None and eval_interval < 1:
            raise ValueError(f"eval_interval: must be >= 1, got {eval_interval}")
        self.run = run
        self.backend_block = backend_block  # external posture: the saved ExternalBackendBlock's name
        self.blocks = blocks or BlockNames()
        self.policy = policy
        self.max_in_flight = max_in_flight
        self.exporter = exporter
        self.lora_base = str(lora_base) if lora_base is not None else None
        self.eval_interval = eval_interval
        self.poll_s = poll_s
        self.idle_sync_s = idle_sync_s
        self.visible_timeout_s = visible_timeout_s
        self._target = ExportTarget(staging_root, storage_options)
        self.host_staging = host_staging or HostStaging()
        self._writes = BackgroundWrites(self.host_staging, run)
        self.rest = PrefectRest(url, http or api_client(settings))
        self.progress = ProgressPublisher(self.rest, run)
        self.admission = AdmissionView(run, visible_timeout_s)
        spool_root = Path(spool_dir) if spool_dir else get_settings().home / "spool"
        self.spool = Spool(spool_root / run_key(run))  # one directory per run, whatever the case
        self.deliverer = Deliverer(
            self.spool,
            Delivery(
                self.rest,
                webhook_url=webhook_url,
                deployment=deployment,
                direct_runs=not webhook_url if direct_runs is None else direct_runs,
                latest_step=lambda: self.progress.latest,
            ),
        )
        for entry in self.spool.pending():  # a previous process's undelivered requests
            self.admission.note(entry)
        self._sync = AdmissionSync(
            run, self.rest, self.admission, self._target, self.blocks,
            spooled=self._spooled, enqueue=self._enqueue, poll_s=poll_s, idle_sync_s=idle_sync_s,
        )
        self.deliverer.start()
        self._sync.start()
        self.deliverer.kick()
        # the first dispatch should already see the server's view (a restarted trainer's points)
        self._sync.wait_first(startup_sync_s)

    @property
    def _staging(self) -> Any:
        return self._target.staging()

    @property
    def storage_options(self) -> dict[str, Any]:
        """The fsspec options an exporter writes `dest` with (`write_snapshot(..., storage_options=)`)."""
        staging = self._staging
        return dict(staging.storage_options) if staging is not None else {}

    # ---- admission -----------------------------------------------------------------------------

    def due(self, step: int, *, final: bool = False) -> bool:
        """Eval due at `(step + 1) % eval_interval == 0` (miles' schedule) and at the final step."""
        return final or self.eval_interval is None or (step + 1) % self.eval_interval == 0

    def in_flight(self) -> set[int]:
        """Query the server now and refresh the view admission reads (`AdmissionView`); returns
        the steps in flight. Network I/O: the admission thread calls it; `dispatch` never does."""
        return self._sync.refresh()

    def _spooled(self) -> set[int]:
        # a snapshot still being written is in flight: its request follows the marker
        return {e.step for e in self.spool.pending() if e.kind != "skip_record"} | self._writes.steps()

    @property
    def synced(self) -> bool:
        """Whether the admission thread's last query of the server answered."""
        return self.admission.fresh

    def wait_synced(self, timeout: float) -> bool:
        """Block until the admission thread has a fresh answer from the server; False on timeout."""
        return self._sync.wait_fresh(timeout)

    # ---- dispatch ------------------------------------------------------------------------------

    def dispatch(
        self,
        step: int,
        source: SnapshotSource | None = None,
        final: bool = False,
        export: Exporter | None = None,
        *,
        posture: Posture = Posture.FLEET,
    ) -> DispatchResult:
        t0 = time.monotonic()
        handed_on = False
        try:
            if step < 0:
                raise ValueError(f"step: must be >= 0, got {step}")
            if not self.due(step, final=final):
                return DispatchResult(step=step, action="not_due", in_flight=0, stall_seconds=time.monotonic() - t0)
            result = self._dispatch_safe(step, source, final, export, posture, t0)
            handed_on = result.action == "exporting"
            return result
        finally:  # a collective's staged buffer not handed to the background writer is handed back
            discard = getattr(export, "discard", None)
            if discard is not None and not handed_on:
                discard()

    def _dispatch_safe(
        self,
        step: int,
        source: SnapshotSource | None,
        final: bool,
        export: Exporter | None,
        posture: Posture,
        t0: float,
    ) -> DispatchResult:
        try:
            return self._dispatch(step, source, final, export or self.exporter, posture, t0)
        except SpoolWriteError as exc:  # a full disk under the spool: nothing can be recorded, say why
            log.error("pinned-eval: %s step %d skipped, its request not spooled: %s", self.run, step, exc)
            return DispatchResult(step=step, action="skipped_spool_failed", in_flight=0, reason=str(exc)[:500],
                                  stall_seconds=time.monotonic() - t0)
        except _INFRA_ERRORS as exc:  # storage or API trouble; a bug or a bad configuration raises
            log.exception("pinned-eval: dispatch of %s step %d failed; recorded as export_failed", self.run, step)
            why = f"dispatch error: {exc!r}"[:500]
            try:
                self._record_skip(step, source, final, posture, "export_failed", "dispatch error (see trainer log)")
            except SpoolWriteError as spool_exc:
                log.error("pinned-eval: export_failed record of %s step %d not spooled: %s", self.run, step, spool_exc)
                why = f"{why}; not recorded: {spool_exc}"[:500]
            return DispatchResult(
                step=step, action="skipped_export_failed", in_flight=0, reason=why, stall_seconds=time.monotonic() - t0
            )

    def _dispatch(
        self,
        step: int,
        source: SnapshotSource | None,
        final: bool,
        export: Exporter | None,
        posture: Posture,
        t0: float,
    ) -> DispatchResult:
        if step in self._writes.steps():  # being written: its request follows
            return DispatchResult(step=step, action="exists", in_flight=0, stall_seconds=time.monotonic() - t0)
        verdict, n, waited, offline = self.admission.decide(
            step, final=final, policy=self.policy, max_in_flight=self.max_in_flight, spooled=self._spooled,
            poll_s=self.poll_s, wake=self._sync.wake,
        )
        common: dict[str, Any] = {"step": step, "in_flight": n, "waited_seconds": waited, "admitted_offline": offline}
        if verdict == "exists":
            return DispatchResult(action="exists", stall_seconds=time.monotonic() - t0, **common)
        if verdict == "busy":
            self._record_skip(step, source, final, posture, "busy", f"{n} points in flight (max {self.max_in_flight})")
            return DispatchResult(action="skipped_busy", stall_seconds=time.monotonic() - t0, **common)
        export_time = None
        if export is not None and source is None and posture is not Posture.SHARED:
            if self._staging is None:
                raise ValueError("staging_root: an in-loop export needs the client's staging_root")
            dest = self._staging.path_for(self.run, step)
            if isinstance(export, (TwoPhaseExport, Staged)):
                return self._two_phase(step, export, dest, final, posture, common, t0)
            e0 = time.monotonic()
            try:
                export(step, dest)
            # any error of the exporter, its own bugs included, is this point's skip: eval never
            # crashes training (logged with its traceback, recorded, returned; never swallowed)
            except Exception as exc:
                log.exception("pinned-eval: in-loop export of %s step %d failed", self.run, step)
                self._staging.delete(dest)
                why = f"in-loop export: {exc!r}"[:500]
                self._record_skip(step, None, final, posture, "export_failed", why)
                return DispatchResult(
                    action="skipped_export_failed", reason=why, stall_seconds=time.monotonic() - t0, **common
                )
            export_time = time.monotonic() - e0
            source = self._staged_source(dest)
        request = self._request(step, source, final, posture, export_time)
        self._enqueue(event_entry(request, self.blocks))  # spooled first: a failed write sends nothing
        self.admission.sent(request)
        return DispatchResult(
            action="requested", export_time_seconds=export_time, stall_seconds=time.monotonic() - t0, **common
        )

    def drain(self, timeout: float) -> list[PointOutcome]:
        """Finish the background writes, then `PointOutcomes.drain` with the time left."""
        deadline = time.monotonic() + timeout
        self._writes.wait(timeout)
        return super().drain(max(0.0, deadline - time.monotonic()))

    def _request(
        self, step: int, source: SnapshotSource | None, final: bool, posture: Posture, export_time: float | None
    ) -> PointRequest:
        return PointRequest(
            run=self.run,
            step=step,
            source=source,
            final=final,
            posture=posture,
            policy=self.policy,
            max_in_flight=self.max_in_flight,
            export_time_seconds=export_time,
            backend_block=self.backend_block if posture is Posture.EXTERNAL else None,
        )

    def _record_skip(
        self, step: int, source: SnapshotSource | None, final: bool, posture: Posture, reason: str, message: str
    ) -> None:
        # never run, so not validated as a runnable request (a busy fleet point has no source yet)
        req = PointRequest.model_construct(
            run=self.run,
            step=step,
            source=source,
            final=final,
            posture=posture,
            policy=self.policy,
            max_in_flight=self.max_in_flight,
            export_time_seconds=None,
        )
        try:
            self._enqueue(skip_record_entry(req, self.blocks, reason, f"step {step}: {message}"))
        except SpoolWriteError as exc:  # say which skip was lost, not only that a record was
            raise SpoolWriteError(exc.errno, f"{reason} (step {step}: {message}) not recorded: {exc.strerror}") from exc

    def _enqueue(self, entry: SpoolEntry) -> None:
        self.spool.append(entry)
        self.admission.note(entry)
        self.deliverer.kick()

    # ---- progress ------------------------------------------------------------------------------

    def report_progress(self, step: int) -> None:
        """Publish the trainer's latest step (read by the flow for `eval/lag_steps`); non-blocking."""
        self.progress.report(step)

    def flush_progress(self, timeout: float = 10.0) -> None:
        """Block until the latest reported step is published (tests, shutdown)."""
        self.progress.flush(timeout)

    async def shared_point(self, step: int, *, final: bool = False, timeout: float = 600.0) -> PointOutcome:
        """Request a `posture="shared"` point at `step` and wait for it (the gate's dispatch_and_wait)."""

        result = await asyncio.to_thread(self._dispatch_safe, step, None, final, None, Posture.SHARED, time.monotonic())
        if result.action not in ("requested", "exists"):
            log.warning("pinned-eval: shared point %s step %d: %s", self.run, step, result.action)
        return await asyncio.to_thread(self.wait_for, step, timeout)

    async def evaluate_now(
        self, step: int, gate: GateLike, *, final: bool = False, timeout: float = 600.0
    ) -> PointOutcome:
        """Shared posture: pause the producer's new submissions, measure the live engines, resume."""
        async with gate.closed(f"shared-engine eval at step {step}"):
            return await self.shared_point(step, final=final, timeout=timeout)

    def close(self) -> None:
        self._writes.wait()  # a snapshot being written is finished and its request spooled
        self._sync.stop()
        self.deliverer.stop()
        self.progress.stop()
        self._sync.join(5)
        self.rest.http.close()

    def __enter__(self) -> EvalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
