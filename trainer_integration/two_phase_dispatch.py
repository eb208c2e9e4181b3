"""`EvalClient`'s two-phase in-loop export (see `trainer_integration.client`, whose contract this is).

`_two_phase(step, export, dest, ...)` runs on the loop's thread: takes the client's host buffer
(`host_staging`) following the point's policy (`backpressure` and the final point wait for the
previous snapshot's write, `skip` records `export_busy`, never a second buffer), stages the
step's tensors (an error there is `export_failed`, the buffer handed back), and hands the staged
snapshot to `BackgroundWrites`; the point's request is spooled by the writer thread once the
marker exists (`export_time_seconds` = staging + write), a failed write is `export_failed`.
A snapshot staged by a collective (`collective_staged.StagedCollective`) arrives with the lease
held, or as a skip/failure that is recorded as such.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from pinned_eval.points import Posture, SnapshotSource, SourceKind
from pinned_eval.snapshot.host_staging import HostStaging, Staged, TwoPhaseExport
from trainer_integration.events import event_entry
from trainer_integration.results import DispatchResult

if TYPE_CHECKING:
    from pinned_eval.events import BlockNames
    from pinned_eval.points import PointRequest
    from trainer_integration.admission import AdmissionView
    from trainer_integration.background_export import BackgroundWrites
    from trainer_integration.spool import SpoolEntry

log = logging.getLogger("trainer_integration.client")


class TwoPhaseDispatch:
    run: str
    policy: Literal["backpressure", "skip"]
    lora_base: str | None
    blocks: BlockNames
    admission: AdmissionView
    host_staging: HostStaging
    _writes: BackgroundWrites

    if TYPE_CHECKING:  # provided by EvalClient

        @property
        def _staging(self) -> Any: ...

        @property
        def storage_options(self) -> dict[str, Any]: ...

        def _request(
            self, step: int, source: SnapshotSource | None, final: bool, posture: Posture, export_time: float | None
        ) -> PointRequest: ...

        def _record_skip(
            self, step: int, source: SnapshotSource | None, final: bool, posture: Posture, reason: str, message: str
        ) -> None: ...

        def _enqueue(self, entry: SpoolEntry) -> None: ...

    def _staged_source(self, dest: str) -> SnapshotSource:
        if self.lora_base is not None:
            return SnapshotSource(kind=SourceKind.LORA, path=dest, hf_base=self.lora_base)
        return SnapshotSource(kind=SourceKind.STAGED, path=dest)

    def _two_phase(
        self, step: int, export: TwoPhaseExport | Staged, dest: str, final: bool, posture: Posture,
        common: dict[str, Any], t0: float,
    ) -> DispatchResult:
        """Stage now (the loop's stall), write in the background, request after the marker."""
        e0 = time.monotonic()
        if isinstance(export, TwoPhaseExport):
            wait = self.policy == "backpressure" or final
            if not self.host_staging.acquire(wait=wait):
                why = "the previous in-loop snapshot is still being written"
                self._record_skip(step, None, final, posture, "export_busy", why)
                return DispatchResult(action="skipped_export_busy", reason=why,
                                      stall_seconds=time.monotonic() - t0, **common)
            common["waited_seconds"] += time.monotonic() - e0
            e0 = time.monotonic()
            try:
                staged = export.stage(step, self.host_staging)
            except Exception as exc:  # as for a plain exporter: this point's skip, never raised
                self.host_staging.release()
                log.exception("pinned-eval: in-loop export of %s step %d failed while staging", self.run, step)
                why = f"in-loop export: {exc!r}"[:500]
                self._record_skip(step, None, final, posture, "export_failed", why)
                return DispatchResult(
                    action="skipped_export_failed", reason=why, stall_seconds=time.monotonic() - t0, **common
                )
        elif getattr(export, "skipped", None) or not getattr(export, "ok", True):  # a collective that staged nothing
            reason = "export_busy" if getattr(export, "skipped", None) else "export_failed"
            why = ("the previous in-loop snapshot is still being written" if reason == "export_busy"
                   else f"in-loop export: {getattr(export, 'error', None)}"[:500])
            self._record_skip(step, None, final, posture, reason, why)
            return DispatchResult(action=f"skipped_{reason}", reason=why,  # type: ignore[arg-type]
                                  stall_seconds=time.monotonic() - t0, **common)
        else:  # staged by a collective on this rank, which holds the buffer's lease
            staged = export
        stage_time = time.monotonic() - e0

        def written(seconds: float) -> None:
            request = self._request(step, self._staged_source(dest), final, posture, stage_time + seconds)
            self._enqueue(event_entry(request, self.blocks))
            self.admission.sent(request)

        def failed(why: str) -> None:
            self._record_skip(step, None, final, posture, "export_failed", why)

        staging = self._staging
        self._writes.start(
            step, staged, dest, storage_options=lambda: self.storage_options, delete=staging.delete,
            on_written=written, on_failed=failed, started=e0,
        )
        return DispatchResult(
            action="exporting", export_time_seconds=stage_time, stall_seconds=time.monotonic() - t0, **common
        )

    def wait_exports(self, timeout: float | None = None) -> bool:
        """Block until no two-phase export is being written (its request or skip is spooled)."""
        return self._writes.wait(timeout)

