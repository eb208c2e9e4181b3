"""What `EvalClient` admits from: one trainer's view of its eval points (no I/O, no Prefect import).

Contract:
- the view joins the server's last answer (`refresh(runs, spooled)`: the run's flow runs, from the
  client's admission thread) with what this process requested (`note(entry)` for every spooled
  request); a point is in flight while its run is not terminal on the server, or while it was
  requested and is not visible there yet (still spooled, or sent less than `visible_timeout_s`
  ago);
- `decide(...)` answers admission from the view alone; it never does I/O. While the view is not
  fresh (no answer yet, or the last query failed: `stale()`) it admits, flagged offline;
  `backpressure` at the bound waits on the view's condition until a refresh frees a slot;
- a request sent whose run never appeared within `visible_timeout_s` is handed back once by
  `refresh` for a direct re-request (then warned about once, and no longer counted).
Thread-safe: every method takes the view's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Literal

from pinned_eval.points import PointRequest
from trainer_integration.rest import PointRun
from trainer_integration.spool import SpoolEntry

log = logging.getLogger(__name__)

Verdict = Literal["ok", "busy", "exists"]


class AdmissionView:
    def __init__(self, run: str, visible_timeout_s: float) -> None:
        self.run = run
        self.visible_timeout_s = visible_timeout_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # refreshed, or marked stale
        self._requested: dict[int, float] = {}  # step -> monotonic time a point was requested (this process)
        self._recorded: set[int] = set()  # steps this client recorded as skipped (never in flight)
        self._sent: dict[int, PointRequest] = {}  # step -> the point request sent (run or event)
        self._fallen_back: set[int] = set()  # steps re-requested as a direct flow run
        self._lost: set[int] = set()  # steps sent whose run never appeared (warned once)
        self._server_busy: set[int] = set()  # non-terminal steps on the server at the last refresh
        self._known: set[int] = set()  # steps with a flow run seen on the server
        self._fresh = False  # the last query of the server answered

    # ---- updates -------------------------------------------------------------------------------

    def note(self, entry: SpoolEntry) -> None:
        """A request was spooled: a point request is in flight until its run is seen; a skip record never is."""
        with self._lock:
            if entry.kind in ("event", "run_request"):
                self._requested[entry.step] = time.monotonic()
            else:
                self._recorded.add(entry.step)

    def sent(self, request: PointRequest) -> None:
        with self._lock:
            self._sent[request.step] = request

    def refresh(self, runs: list[PointRun], spooled: set[int]) -> tuple[set[int], list[PointRequest]]:
        """The server answered with `runs`: returns the steps in flight and the requests to re-send
        as direct runs (sent, accepted, but no run appeared)."""
        fallback: list[PointRequest] = []
        with self._lock:
            self._known |= {r.step for r in runs}
            self._server_busy = {r.step for r in runs if not r.terminal}
            self._fresh = True
            busy = self._busy(spooled, fallback)
            self._changed.notify_all()
        return busy, fallback

    def seen(self, steps: set[int]) -> None:
        with self._lock:
            self._known |= steps

    def stale(self) -> None:
        """The server did not answer: admit offline until it does again."""
        with self._lock:
            self._fresh = False
            self._changed.notify_all()

    # ---- reads ---------------------------------------------------------------------------------

    @property
    def fresh(self) -> bool:
        with self._lock:
            return self._fresh

    def wait_fresh(self, timeout: float) -> bool:
        with self._lock:
            return self._changed.wait_for(lambda: self._fresh, timeout)

    def active(self) -> bool:
        """Whether any point may still be in flight (the admission thread then refreshes often)."""
        with self._lock:
            return bool(self._server_busy) or any(s not in self._known for s in self._requested)

    def unseen(self) -> list[int]:
        """Steps this process requested whose flow run was not seen on the server yet."""
        with self._lock:
            return sorted(s for s in self._requested if s not in self._known)

    def steps(self) -> set[int]:
        with self._lock:
            return set(self._requested) | self._recorded | self._known

    def decide(
        self,
        step: int,
        *,
        final: bool,
        policy: str,
        max_in_flight: int,
        spooled: Callable[[], set[int]],
        poll_s: float,
        wake: Callable[[], None],
    ) -> tuple[Verdict, int, float, bool]:
        """(verdict, points in flight but this one, seconds waited for a slot, admitted offline)."""
        waited = 0.0
        with self._lock:
            while True:
                offline = not self._fresh
                others = self._busy(spooled()) - {step}
                if step in self._known or step in self._requested or step in self._recorded:
                    return "exists", len(others), waited, offline
                if offline:
                    log.info("pinned-eval: %s step %d admitted without a fresh view of the API", self.run, step)
                    return "ok", len(others), waited, True
                if len(others) < max_in_flight:
                    return "ok", len(others), waited, False
                if policy == "skip" and not final:
                    return "busy", len(others), waited, False
                t0 = time.monotonic()
                wake()
                self._changed.wait(poll_s)
                waited += time.monotonic() - t0

    def _busy(self, spooled: set[int], fallback: list[PointRequest] | None = None) -> set[int]:
        """Steps in flight (caller holds the lock). With `fallback` (a refresh), a sent point whose
        run never appeared is queued there, once."""
        # spooled steps never noted as requested: snapshots being written in the background
        busy = set(self._server_busy) | {s for s in spooled if s not in self._requested and s not in self._known}
        now = time.monotonic()
        for step, at in self._requested.items():
            if step in self._known:
                continue
            if step in spooled or now - at < self.visible_timeout_s:
                busy.add(step)
            elif fallback is None:
                continue
            elif step in self._sent and step not in self._fallen_back:
                # the request was accepted but no run appeared: create the run directly, once
                # (the idempotency key is the event id, so a late trigger run is not doubled)
                log.warning("pinned-eval: %s step %d: no flow run from its event; creating it", self.run, step)
                self._fallen_back.add(step)
                fallback.append(self._sent[step])
                busy.add(step)
            elif step not in self._lost:
                self._lost.add(step)
                log.warning("pinned-eval: %s step %d was sent but no flow run appeared", self.run, step)
        return busy
