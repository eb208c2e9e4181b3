"""Phase 2 of a two-phase in-loop export: the snapshot written off the training loop's thread.

Contract of `BackgroundWrites` (one per `EvalClient`, sharing the client's `HostStaging`):
- `start(step, staged, dest, ...)` writes `staged` to `dest` in a thread of its own; the caller
  holds the staging lease, and the thread hands it back once the write ended (either way), so
  host memory stays one snapshot's worth and the next export may stage;
- on success `on_written(seconds)` runs (the client then spools the point's request: a point is
  requested only once its `.complete` marker exists); on any exception the partial output is
  removed (`delete(dest)`, marker first) and `on_failed(reason)` records that step's
  `export_failed`. Nothing raises into the training loop, and no callback's error kills the
  thread (logged);
- `steps()` is the step being written (admission counts it in flight; a second dispatch of that
  step is `exists`), until its request or skip record is spooled;
- `wait(timeout)` blocks until no write is in progress (`EvalClient.wait_exports`, `drain` and
  `close` call it); the writer thread is not a daemon, so an interpreter that exits without
  `close` still finishes the write.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pinned_eval.snapshot.host_staging import HostStaging, Staged

log = logging.getLogger(__name__)


class BackgroundWrites:
    def __init__(self, pool: HostStaging, run: str) -> None:
        self.pool, self.run = pool, run
        self._cond = threading.Condition()
        self._steps: set[int] = set()

    def steps(self) -> set[int]:
        with self._cond:
            return set(self._steps)

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._steps, timeout)

    def start(
        self,
        step: int,
        staged: Staged,
        dest: str,
        *,
        storage_options: Callable[[], dict[str, Any]],
        delete: Callable[[str], None],
        on_written: Callable[[float], None],
        on_failed: Callable[[str], None],
        started: float,
    ) -> None:
        with self._cond:
            self._steps.add(step)
        args = (step, staged, dest, storage_options, delete, on_written, on_failed, started)
        threading.Thread(target=self._run, args=args, name=f"pinned-eval-export-{step}").start()

    def _run(
        self,
        step: int,
        staged: Staged,
        dest: str,
        storage_options: Callable[[], dict[str, Any]],
        delete: Callable[[str], None],
        on_written: Callable[[float], None],
        on_failed: Callable[[str], None],
        started: float,
    ) -> None:
        try:
            try:
                staged.write(dest, storage_options())
            except Exception as exc:  # the step's export_failed, never the loop's exception
                log.exception("pinned-eval: background write of %s step %d failed", self.run, step)
                try:
                    delete(dest)
                except Exception:
                    log.exception("pinned-eval: partial snapshot of %s step %d not removed", self.run, step)
                self.pool.release()
                _safely(on_failed, f"in-loop export (background write): {exc!r}"[:500], self.run, step)
            else:
                self.pool.release()
                _safely(on_written, time.monotonic() - started, self.run, step)
        finally:
            with self._cond:
                self._steps.discard(step)
                self._cond.notify_all()


def _safely(callback: Callable[[Any], None], arg: Any, run: str, step: int) -> None:
    try:
        callback(arg)
    except Exception:  # e.g. a full disk under the spool: logged, the thread ends cleanly
        log.exception("pinned-eval: the outcome of %s step %d's background write was not recorded", run, step)
