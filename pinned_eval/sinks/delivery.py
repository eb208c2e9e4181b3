"""The deliverer: sends the envelopes of a worker's outbox, one process per outbox (no Prefect here).

`Deliverer.run(stop)` holds the outbox's deliverer lock (waiting while another deliverer holds
it), then sends each envelope, oldest first, as it arrives (the directory is looked at every
`poll_s` while idle): each parcel goes to the exporter its registration restores
(`pinned_eval.sinks.EXPORTERS`), retried like a point's export (`attempt_sink`), under the lock
the exporter declared (`hold`: the process passes Prefect's `tasks.admission.exclusive`). An
exporter that still failed is noted in the point's ledger rows (`sink_errors`,
`eval/sink_failed_<name>`, merged with what the point noted itself) and in a WARNING, but only
while those rows are still the ones the envelope came from (same flow run): a rerun that has
replaced them is not marked by an older point's failure. Then the envelope is removed.

After `stop` is set the deliverer keeps sending what is waiting for up to `drain_s`, then
returns; the rest stays in the outbox for the next deliverer. Only `Exception`s are caught: an
error in one envelope never stops the others.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from pathlib import Path

from pinned_eval.sinks.exporters import Exporter, Hold, Parcel, attempt_sink, restore_exporter, with_sink_errors
from pinned_eval.sinks.ledger import Ledger, MetricRow
from pinned_eval.sinks.outbox import Envelope, Outbox

log = logging.getLogger(__name__)


class Deliverer:
    def __init__(self, outbox: Outbox, hold: Hold | None = None, *, poll_s: float = 0.2,
                 drain_s: float = 20.0) -> None:
        self.outbox = outbox
        self.hold = hold
        self.poll_s = poll_s
        self.drain_s = drain_s
        self.delivered = 0  # envelopes sent or noted by this deliverer

    def run(self, stop: threading.Event) -> None:
        """Serve the outbox until `stop` is set, then drain (see the module docstring)."""
        with self.outbox.serving(stop, self.poll_s) as serving:
            if not serving:
                return
            while not stop.is_set():
                if not self.deliver_pending(stop):
                    stop.wait(self.poll_s)
            deadline = time.monotonic() + self.drain_s
            self.deliver_pending(None, deadline)
            left = len(self.outbox.pending())
            if left:
                log.warning("deliverer stopping: %d envelope(s) left in %s for the next deliverer",
                            left, self.outbox.root)

    def deliver_pending(self, stop: threading.Event | None, deadline: float | None = None) -> int:
        """Send every waiting envelope (until `stop` is set or `deadline`); returns how many."""
        self.outbox.sweep()
        done = 0
        for path in self.outbox.pending():
            if (stop is not None and stop.is_set()) or (deadline is not None and time.monotonic() > deadline):
                break
            self.deliver(path)
            done += 1
        return done

    def deliver(self, path: Path) -> dict[str, str]:
        """Send one envelope; returns {exporter: error} of the parcels that failed."""
        try:
            envelope = self.outbox.read(path)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            self.outbox.reject(path, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            return {}
        errors: dict[str, str] = {}
        for parcel in envelope.parcels:
            try:
                exporter = restore_exporter(parcel)
            except Exception as exc:
                errors[parcel.exporter] = f"{type(exc).__name__}: {exc}"
                continue
            try:
                error = attempt_sink(partial(self._send, exporter, parcel))
            finally:
                exporter.close()
            if error is not None:
                errors[parcel.exporter] = exporter.describe_failure(error)
        if errors:
            self._note(envelope, errors)
        self.outbox.remove(path)
        self.delivered += 1
        return errors

    def _send(self, exporter: Exporter, parcel: Parcel) -> None:
        if parcel.lock is not None and self.hold is not None:
            with self.hold(parcel.lock):
                exporter.send(parcel)
        else:
            exporter.send(parcel)

    def _note(self, envelope: Envelope, errors: dict[str, str]) -> None:
        for sink, error in sorted(errors.items()):
            log.warning("sink %s failed for %s/step-%d (sent by the deliverer); the point keeps its outcome: %s",
                        sink, envelope.run, envelope.step, error)
        if envelope.ledger is None:
            return

        def note(rows: list[MetricRow]) -> list[MetricRow] | None:
            if any(r.flow_run_id != envelope.flow_run_id for r in rows):
                return None  # replaced by a rerun meanwhile
            return [with_sink_errors(r, errors) for r in rows]

        try:
            noted = Ledger(envelope.ledger).update_point(envelope.run, envelope.step, note)
        except OSError as exc:
            log.warning("ledger %s: the failure of %s/step-%d not noted: %s", envelope.ledger, envelope.run,
                        envelope.step, exc)
            return
        if not noted:
            log.info("%s/step-%d: rows replaced since; the failure is not noted on them", envelope.run, envelope.step)
