"""`EvalClient`'s admission thread: all of admission's network I/O, off the training loop's thread.

Contract:
- one daemon thread queries the run's point flow runs and hands the answer to the `AdmissionView`
  (`refresh`), every `poll_s` while a point may be in flight or the last query failed,
  `idle_sync_s` otherwise, and at once after `wake()`;
- the first query that answers reads the run's whole history (paged; what already exists is
  known); every later one asks only for what can be in flight or changed since the previous
  answer (`PrefectRest.point_runs_changed`: runs not terminal, runs that ended since the previous
  answer's server time less `CHANGED_MARGIN_S`, and runs named after a requested step not seen
  yet), so its cost follows the points in flight, not the run's length. A server that sends no
  `Date` header gets the whole-history query every time;
- a failed query (API unreachable, an HTTP error, a garbled answer) marks the view stale, so
  admission admits offline rather than trusting an old answer (logged at debug, at warning once it
  has failed for over a minute); when the thread ends (`stop`, or an unexpected error) the view is
  marked stale too;
- a request the view hands back (sent, but its run never appeared) is spooled again as a direct
  run request (`enqueue`);
- while the export target still wants the staging block's S3 credentials, each pass reads them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta

import httpx

from pinned_eval.events import BlockNames
from trainer_integration.admission import AdmissionView
from trainer_integration.events import run_request_entry
from trainer_integration.export_target import ExportTarget
from trainer_integration.rest import ApiUnavailableError, PrefectRest
from trainer_integration.spool import SpoolEntry, SpoolWriteError

log = logging.getLogger(__name__)

CHANGED_MARGIN_S = 120.0  # covers commit lag and a worker's clock behind the server's (end_time is proposed)


class AdmissionSync:
    def __init__(
        self,
        run: str,
        rest: PrefectRest,
        view: AdmissionView,
        target: ExportTarget,
        blocks: BlockNames,
        *,
        spooled: Callable[[], set[int]],
        enqueue: Callable[[SpoolEntry], None],
        poll_s: float,
        idle_sync_s: float,
        changed_margin_s: float = CHANGED_MARGIN_S,
    ) -> None:
        self.run = run
        self.rest = rest
        self.view = view
        self._target = target
        self._blocks = blocks
        self._spooled = spooled
        self._enqueue = enqueue
        self._poll_s = poll_s
        self._idle_sync_s = idle_sync_s
        self._margin = timedelta(seconds=changed_margin_s)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._since: datetime | None = None  # the next incremental query's `since` (None: read everything)
        self._first = threading.Event()  # the first query answered or failed
        self._thread = threading.Thread(target=self._loop, name="pinned-eval-admission", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_first(self, timeout: float) -> None:
        """Block until the thread's first query answered or failed, at most `timeout` seconds."""
        self._first.wait(timeout)

    def refresh(self) -> set[int]:
        """Query the server now and refresh the view; returns the steps in flight (network I/O)."""
        if self._since is None:
            runs, at = self.rest.point_runs_at(self.run)
        else:
            runs, at = self.rest.point_runs_changed(self.run, self._since, self.view.unseen())
        self._since = None if at is None else at - self._margin
        busy, fallback = self.view.refresh(runs, self._spooled())
        for request in fallback:
            self._enqueue(run_request_entry(request, self._blocks))
        return busy

    def wake(self) -> None:
        """Query again now rather than at the next interval."""
        self._wake.set()

    def wait_fresh(self, timeout: float) -> bool:
        """Wake the thread and block until the view is fresh; False on timeout."""
        self._wake.set()
        return self.view.wait_fresh(timeout)

    def stop(self) -> None:
        """Ask the thread to end (it ends after its current pass; `join` waits for it)."""
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _loop(self) -> None:
        failing_since: float | None = None
        try:
            while not self._stop.is_set():
                self._wake.clear()
                try:
                    self.refresh()
                    failing_since = None
                except (ApiUnavailableError, httpx.HTTPError, ValueError) as exc:  # ValueError: a garbled answer
                    self.view.stale()
                    now = time.monotonic()
                    failing_since = failing_since or now
                    level = logging.WARNING if now - failing_since > 60 else logging.DEBUG
                    log.log(level, "pinned-eval: admission state of %s not refreshed (%s)", self.run, exc)
                except SpoolWriteError as exc:  # a fallback re-send not spooled (full disk): logged, thread lives on
                    log.error("pinned-eval: fallback re-send for %s not spooled: %s", self.run, exc)
                self._fetch_staging_block()
                self._first.set()
                busy = self.view.active() or failing_since is not None
                self._wake.wait(self._poll_s if busy else self._idle_sync_s)
        finally:
            self.view.stale()
            self._first.set()

    def _fetch_staging_block(self) -> None:
        if not self._target.wants_block:
            return
        try:
            self._target.fetch(self.rest, self._blocks.staging)
        except (ApiUnavailableError, httpx.HTTPError) as exc:
            log.debug("pinned-eval: staging block %r not read yet (%s)", self._blocks.staging, exc)
