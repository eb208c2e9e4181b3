"""`EvalClient`: the training loop's dispatcher of eval points (no Prefect import).

Contract:
- `dispatch(step, source=None, final=False, export=None)` admits the point *before* any in-loop
  export, from the orchestrator's truth: the run's non-terminal eval-point flow runs, plus the
  points this client requested that are not visible there yet (spooled, or sent and awaiting the
  trigger), deduplicated by step. So a restarted trainer resumes with its in-flight points.
  At `max_in_flight`: `skip` (never for the final point) records `busy` at the step without
  exporting; `backpressure` waits for the oldest point. When the API is unreachable the point is
  admitted (the flow's own global concurrency limit still bounds it) and spooled.
- an in-loop export (`export(step, dest)`) writes into `<staging_root>/<run>/step_<step:08d>`,
  is timed as `export_time_seconds`; a storage or converter failure of it
  (`pinned_eval.snapshot.errors.EXPORT_ERRORS`) removes the partial output and records
  `export_failed` at the step. An `s3://` staging root uses `storage_options`, else the saved
  staging block's endpoint and credentials (fetched once, by name, over the API).
- every request is written ahead to the durable spool and sent by a background thread, so the
  non-waiting call costs the loop one admission query plus one fsync; `dispatch` never raises
  into training for storage or API failures (logged, they become skip records); a programming
  or configuration error (a bad argument, no `staging_root` for an in-loop export) raises.
  A step already requested or recorded is not requested again.
- `report_progress(step)` publishes the trainer's step in the Variable the flow reads for
  `eval/lag_steps` (latest value wins, sent in the background).
- `drain(timeout)` delivers the spool and waits for every point to be terminal; `results()`
  reads each point's outcome from its flow run state (and metrics from the JSONL sink).
- `evaluate_now(step, gate)` (shared posture): closes the producer gate, requests a
  `posture="shared"` point, waits for it, and reopens the gate in `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx

from pinned_eval.events import BlockNames
from pinned_eval.points import PointRequest, Posture, SnapshotSource, SourceKind, progress_variable_name
from pinned_eval.polling import PollTimeout, poll_until
from pinned_eval.settings import PrefectApiSettings, get_settings
from pinned_eval.sinks import JsonlSink
from pinned_eval.snapshot.errors import EXPORT_ERRORS
from trainer_integration.events import (
    SINKS_BLOCK_SLUG,
    STAGING_BLOCK_SLUG,
    Delivery,
    event_entry,
    run_request_entry,
    skip_record_entry,
)
from trainer_integration.rest import ApiUnavailableError, PointRun, PrefectRest, api_client
from trainer_integration.results import DispatchResult, PointOutcome, point_outcome
from trainer_integration.spool import Deliverer, Spool, SpoolEntry

log = logging.getLogger(__name__)

Exporter = Callable[[int, str], object]
# what `dispatch` turns into an `export_failed` record instead of raising into the training loop
_INFRA_ERRORS: tuple[type[BaseException], ...] = (*EXPORT_ERRORS, ApiUnavailableError, httpx.HTTPError)


class GateLike(Protocol):
    """What `evaluate_now` needs of a producer gate (`trainer_integration.gate.ProducerGate`)."""

    def closed(self, reason: str = "") -> AbstractAsyncContextManager[object]: ...


class EvalClient:
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
        visible_timeout_s: float = 120.0,
        backend: str | None = None,
        backend_options: dict[str, Any] | None = None,
        lora_base: str | Path | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        """`lora_base`: in-loop exports write a PEFT LoRA adapter (e.g. `write_adapter_snapshot(peft_model,
        dest)`) for this base HF dir, so they are dispatched as `lora` sources (the fleet block's
        `lora_mode` serves them as an adapter or merged)."""
        settings = settings or PrefectApiSettings()
        url = api_url or settings.api_url
        if not url:
            raise ValueError("api_url: pass it or set PREFECT_API_URL")
        # validated once here, so a bad run name fails at construction, not in the loop
        PointRequest(run=run, step=0, posture=Posture.SHARED, policy=policy, max_in_flight=max_in_flight)
        if eval_interval is not None and eval_interval < 1:
            raise ValueError(f"eval_interval: must be >= 1, got {eval_interval}")
        self.run = run
        self.backend, self.backend_options = backend, backend_options  # external posture's CheckpointEvalFn
        self.blocks = blocks or BlockNames()
        self.policy = policy
        self.max_in_flight = max_in_flight
        self.exporter = exporter
        self.lora_base = str(lora_base) if lora_base is not None else None
        self.eval_interval = eval_interval
        self.poll_s = poll_s
        self.visible_timeout_s = visible_timeout_s
        self._staging_root = str(staging_root) if staging_root is not None else None
        self._storage_options = storage_options
        self._store: Any = None
        self.rest = PrefectRest(url, http or api_client(settings))
        self._latest_step: int | None = None
        self._progress = threading.Event()
        self._requested: dict[int, float] = {}  # step -> monotonic time a point was requested (this process)
        self._recorded: set[int] = set()  # steps this client recorded as skipped (never in flight)
        self._sent: dict[int, PointRequest] = {}  # step -> the point request sent as an event
        self._fallen_back: set[int] = set()  # steps re-requested as a direct flow run
        self._lock = threading.Lock()
        spool_root = Path(spool_dir) if spool_dir else get_settings().home / "spool"
        self.spool = Spool(spool_root / run)
        self.deliverer = Deliverer(
            self.spool,
            Delivery(
                self.rest,
                webhook_url=webhook_url or settings.webhook_url,
                deployment=deployment,
                latest_step=lambda: self._latest_step,
            ),
        )
        for entry in self.spool.pending():  # a previous process's undelivered requests
            self._note(entry)
        self._known: set[int] = set()  # steps with a flow run seen on the server
        self._stop = threading.Event()
        self._progress_thread = threading.Thread(target=self._progress_loop, name="pinned-eval-progress", daemon=True)
        self.deliverer.start()
        self._progress_thread.start()
        self.deliverer.kick()

    @property
    def _staging(self) -> Any:
        """The in-loop export's `Staging`, built at the first export. An `s3://` root without
        explicit `storage_options` is written with the staging block's endpoint and credentials
        (read by name over the API, as the points read it); a failure here is that point's
        `export_failed`, never an exception in the loop."""
        if self._store is None and self._staging_root is not None:
            from pinned_eval.snapshot.staging import Staging

            options = self._storage_options
            if options is None and self._staging_root.startswith(("s3://", "s3a://")):
                options = self._block_s3_options()
            self._store = Staging(self._staging_root, storage_options=options)
        return self._store

    @property
    def storage_options(self) -> dict[str, Any]:
        """The fsspec options an exporter writes `dest` with (`write_snapshot(..., storage_options=)`)."""
        return dict(self._staging.storage_options) if self._staging is not None else {}

    def _block_s3_options(self) -> dict[str, Any]:
        from pinned_eval.snapshot.layout import s3_storage_options

        data = self.rest.block_data(STAGING_BLOCK_SLUG, self.blocks.staging, include_secrets=True)
        if data is None:
            raise ValueError(
                f"staging_root: {self._staging_root} is on S3 but the staging block {self.blocks.staging!r} "
                "does not exist; save it or pass storage_options"
            )
        return s3_storage_options(
            data.get("endpoint_url"), data.get("region_name"), data.get("aws_access_key_id"),
            data.get("aws_secret_access_key"),
        )

    # ---- admission -----------------------------------------------------------------------------

    def due(self, step: int, *, final: bool = False) -> bool:
        """Eval due at `(step + 1) % eval_interval == 0` (miles' schedule) and at the final step."""
        return final or self.eval_interval is None or (step + 1) % self.eval_interval == 0

    def in_flight(self) -> set[int]:
        """Steps in flight: non-terminal runs on the server plus requested-but-not-visible ones."""
        runs = self.rest.point_runs(self.run)
        seen = {r.step for r in runs}
        busy = {r.step for r in runs if not r.terminal}
        now = time.monotonic()
        spooled = {e.step for e in self.spool.pending() if e.kind != "skip_record"}
        fallback: list[PointRequest] = []
        with self._lock:
            self._known |= seen
            for step, at in self._requested.items():
                if step in seen:
                    continue
                if step in spooled or now - at < self.visible_timeout_s:
                    busy.add(step)
                elif step in self._sent and step not in self._fallen_back:
                    # the event was accepted but no run appeared: create the run directly, once
                    # (the idempotency key is the event id, so a late trigger run is not doubled)
                    log.warning("pinned-eval: %s step %d: no flow run from its event; creating it", self.run, step)
                    self._fallen_back.add(step)
                    fallback.append(self._sent[step])
                    busy.add(step)
                else:
                    log.warning("pinned-eval: %s step %d was sent but no flow run appeared", self.run, step)
        for request in fallback:
            self._enqueue(run_request_entry(request, self.blocks))
        return busy

    def _local_in_flight(self) -> set[int]:
        with self._lock:
            spooled = {e.step for e in self.spool.pending() if e.kind != "skip_record"}
            return {s for s in self._requested if s not in self._known} | spooled

    def _admit(self, step: int, final: bool) -> tuple[str, int, float, bool]:
        """('ok'|'busy'|'exists', points in flight, seconds waited for a slot, admitted offline)."""
        waited = 0.0
        while True:
            try:
                busy = self.in_flight()
            except (ApiUnavailableError, httpx.HTTPStatusError) as exc:
                local = self._local_in_flight() - {step}
                with self._lock:
                    if step in self._known or step in self._requested or step in self._recorded:
                        return "exists", len(local), waited, True
                log.warning("pinned-eval: admission of %s step %d without the API (%s)", self.run, step, exc)
                return "ok", len(local), waited, True
            with self._lock:
                if step in self._known or step in self._requested or step in self._recorded:
                    return "exists", len(busy - {step}), waited, False
            others = busy - {step}
            if len(others) < self.max_in_flight:
                return "ok", len(others), waited, False
            if self.policy == "skip" and not final:
                return "busy", len(others), waited, False
            time.sleep(self.poll_s)
            waited += self.poll_s

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
        if not self.due(step, final=final):
            return DispatchResult(step=step, action="not_due", in_flight=0, stall_seconds=time.monotonic() - t0)
        return self._dispatch_safe(step, source, final, export, posture, t0)

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
        except _INFRA_ERRORS:  # storage or API trouble; a bug or a bad configuration raises
            log.exception("pinned-eval: dispatch of %s step %d failed; recorded as export_failed", self.run, step)
            self._record_skip(step, source, final, posture, "export_failed", "dispatch error (see trainer log)")
            return DispatchResult(
                step=step, action="skipped_export_failed", in_flight=0, stall_seconds=time.monotonic() - t0
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
        verdict, n, waited, offline = self._admit(step, final)
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
            e0 = time.monotonic()
            try:
                export(step, dest)
            except EXPORT_ERRORS as exc:  # storage or converter failure; a bug in `export` raises
                log.exception("pinned-eval: in-loop export of %s step %d failed", self.run, step)
                self._staging.delete(dest)
                self._record_skip(step, None, final, posture, "export_failed", f"in-loop export: {exc!r}"[:500])
                return DispatchResult(action="skipped_export_failed", stall_seconds=time.monotonic() - t0, **common)
            export_time = time.monotonic() - e0
            source = (
                SnapshotSource(kind=SourceKind.LORA, path=dest, hf_base=self.lora_base)
                if self.lora_base is not None
                else SnapshotSource(kind=SourceKind.STAGED, path=dest)
            )
        request = self._request(step, source, final, posture, export_time)
        with self._lock:
            self._sent[step] = request
        self._enqueue(event_entry(request, self.blocks))
        return DispatchResult(
            action="requested", export_time_seconds=export_time, stall_seconds=time.monotonic() - t0, **common
        )

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
            backend=self.backend if posture is Posture.EXTERNAL else None,
            backend_options=self.backend_options if posture is Posture.EXTERNAL else None,
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
        self._enqueue(skip_record_entry(req, self.blocks, reason, f"step {step}: {message}"))

    def _enqueue(self, entry: SpoolEntry) -> None:
        self.spool.append(entry)
        with self._lock:
            self._note(entry)
        self.deliverer.kick()

    def _note(self, entry: SpoolEntry) -> None:
        """Remember a request: a point request is in flight until its run is seen; a skip record never is."""
        if entry.kind in ("event", "run_request"):
            self._requested[entry.step] = time.monotonic()
        else:
            self._recorded.add(entry.step)

    # ---- progress ------------------------------------------------------------------------------

    def report_progress(self, step: int) -> None:
        """Publish the trainer's latest step (read by the flow for `eval/lag_steps`); non-blocking."""
        self._latest_step = step
        self._progress.set()

    def _progress_loop(self) -> None:
        sent: int | None = None
        failing_since: float | None = None
        name = progress_variable_name(self.run)
        while not self._stop.is_set():
            self._progress.wait(1.0)
            self._progress.clear()
            step = self._latest_step
            if step is None or step == sent:
                continue
            try:
                self.rest.set_variable(name, step)
                sent, failing_since = step, None
            except (ApiUnavailableError, httpx.HTTPStatusError) as exc:
                # a busy server (SQLite locked → 503) is routine; the latest step is retried next second
                now = time.monotonic()
                failing_since = failing_since or now
                level = logging.WARNING if now - failing_since > 60 else logging.DEBUG
                log.log(level, "pinned-eval: progress of %s not published (%s)", self.run, exc)
                self._stop.wait(1.0)

    def flush_progress(self, timeout: float = 10.0) -> None:
        """Block until the latest reported step is published (tests, shutdown)."""
        name = progress_variable_name(self.run)

        def published() -> bool:
            if self._latest_step is None or self.rest.get_variable(name) == self._latest_step:
                return True
            self._progress.set()
            return False

        poll_until(published, timeout_s=timeout, interval_s=0.1, what=f"progress of {self.run} published")

    # ---- outcomes ------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(set(self._requested) | self._recorded | self._known)

    def results(self) -> list[PointOutcome]:
        runs = self.rest.point_runs(self.run)
        rows = self._sink_rows()
        with self._lock:
            self._known |= {r.step for r in runs}
        by_step: dict[int, list[PointRun]] = {}
        for r in runs:
            by_step.setdefault(r.step, []).append(r)
        return [point_outcome(s, by_step.get(s, []), rows.get(s, {})) for s in sorted(set(by_step) | set(self.steps()))]

    def _sink_rows(self) -> dict[int, dict[str | None, dict[str, float]]]:
        data = self.rest.block_data(SINKS_BLOCK_SLUG, self.blocks.sinks)
        path = (data or {}).get("jsonl_path")
        out: dict[int, dict[str | None, dict[str, float]]] = {}
        if path and Path(path).exists():
            for row in JsonlSink(path).read(self.run):
                out.setdefault(row.step, {})[row.dataset] = row.metrics
        return out

    def wait_for(self, step: int, timeout: float) -> PointOutcome:
        def outcome() -> PointOutcome:
            return next((o for o in self.results() if o.step == step), PointOutcome(step=step, state="pending"))

        def done() -> PointOutcome | None:
            o = outcome()
            return o if o.state != "pending" else None

        with contextlib.suppress(PollTimeout):  # still pending at the timeout: returned as pending
            return poll_until(done, timeout_s=timeout, interval_s=self.poll_s, what="")
        return outcome()

    def drain(self, timeout: float) -> list[PointOutcome]:
        """Deliver the spool, then wait until every point is terminal (pending ones stay `pending`)."""
        deadline = time.monotonic() + timeout
        if not self.deliverer.flush(timeout):
            log.warning("pinned-eval: %d requests of %s still spooled", len(self.spool.pending()), self.run)

        def settled() -> list[PointOutcome] | None:
            outcomes = self.results()
            return outcomes if all(o.state != "pending" for o in outcomes) else None

        with contextlib.suppress(PollTimeout):  # pending ones at the timeout stay `pending`
            return poll_until(settled, timeout_s=max(0.0, deadline - time.monotonic()), interval_s=self.poll_s, what="")
        return self.results()

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
        self._stop.set()
        self._progress.set()
        self.deliverer.stop()
        self._progress_thread.join(5)
        self.rest.http.close()

    def __enter__(self) -> EvalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
