"""The trainer's latest step, published in the Prefect Variable the flow reads for `eval/lag_steps`.

Contract: `report(step)` only records the step (no I/O); a background thread named
`pinned-eval-progress` sends the latest value (latest wins) and retries a busy or unreachable API
every second. `flush(timeout)` blocks until the latest step is published (tests, shutdown).
"""

from __future__ import annotations

import logging
import threading
import time

import httpx

from pinned_eval.points import progress_variable_name
from pinned_eval.polling import poll_until
from trainer_integration.rest import ApiUnavailableError, PrefectRest

log = logging.getLogger(__name__)


class ProgressPublisher:
    def __init__(self, rest: PrefectRest, run: str) -> None:
        self.rest, self.run = rest, run
        self.latest: int | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pinned-eval-progress", daemon=True)
        self._thread.start()

    def report(self, step: int) -> None:
        self.latest = step
        self._wake.set()

    def _loop(self) -> None:
        sent: int | None = None
        failing_since: float | None = None
        name = progress_variable_name(self.run)
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            step = self.latest
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

    def flush(self, timeout: float = 10.0) -> None:
        name = progress_variable_name(self.run)

        def published() -> bool:
            if self.latest is None or self.rest.get_variable(name) == self.latest:
                return True
            self._wake.set()
            return False

        poll_until(published, timeout_s=timeout, interval_s=0.1, what=f"progress of {self.run} published")

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)
