"""A local durable spool of requests to the orchestrator, delivered in order by one thread.

Contract:
- `Spool.append(entry)` is the write-ahead step of every request: the entry is written to a temp
  file, fsync'd, renamed to `<seq:012d>.json` and the directory fsync'd before it returns, so an
  acknowledged entry survives a crash of the trainer or the host;
- entries are delivered strictly in sequence order; an entry is deleted only after its delivery
  succeeded (2xx); a transient failure (API unreachable, 5xx, 429) stops the pass and is retried
  with backoff, so nothing is reordered or lost; a permanent rejection (another 4xx) moves the
  entry to `rejected/` with the reason, so one bad entry cannot block the rest;
- exactly once comes from the receiver: every entry carries an idempotency key (the event id,
  uuid5 of run and step, or a flow-run idempotency key), so a redelivery after a lost 2xx is one
  point on the server;
- one spool directory has one deliverer at a time (an exclusive `flock` on `.lock`); a second
  process on the same directory appends but does not deliver until the first releases it.
No Prefect import.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


class SpoolEntry(BaseModel):
    """One request: an event to send, or a flow run to create (a trainer-side skip record)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["event", "skip_record", "run_request"]
    run: str
    step: int = Field(ge=0)
    key: str = Field(min_length=1, description="Idempotency key on the receiver.")
    body: dict[str, Any]
    seq: int | None = Field(default=None, description="Spool sequence number once appended.")


class TransientDeliveryError(RuntimeError):
    """The receiver is unreachable or failing now; retry the same entry later."""


class RejectedDeliveryError(RuntimeError):
    """The receiver refused the entry for good (a 4xx other than 408/429)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Spool:
    """Append-only directory of request files, oldest sequence number first."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "rejected").mkdir(exist_ok=True)
        self._lock = threading.Lock()
        self._next = max((e.seq or 0 for e in self.pending()), default=0) + 1

    def append(self, entry: SpoolEntry) -> SpoolEntry:
        """Durably append `entry`; returns it with its sequence number."""
        with self._lock:
            seq = self._next
            self._next += 1
            stored = entry.model_copy(update={"seq": seq})
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(stored.model_dump_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / f"{seq:012d}.json")
            _fsync_dir(self.dir)
            return stored

    def pending(self) -> list[SpoolEntry]:
        entries = []
        for path in sorted(self.dir.glob("[0-9]*.json")):
            try:
                entries.append(SpoolEntry.model_validate_json(path.read_text()))
            except FileNotFoundError:  # delivered and removed by the deliverer meanwhile
                continue
        return entries

    def remove(self, entry: SpoolEntry) -> None:
        (self.dir / f"{entry.seq:012d}.json").unlink(missing_ok=True)
        _fsync_dir(self.dir)

    def reject(self, entry: SpoolEntry, why: str) -> None:
        src = self.dir / f"{entry.seq:012d}.json"
        dest = self.dir / "rejected" / src.name
        dest.write_text(json.dumps({"entry": entry.model_dump(mode="json"), "why": why}))
        src.unlink(missing_ok=True)
        _fsync_dir(self.dir)

    def rejected(self) -> list[tuple[SpoolEntry, str]]:
        out = []
        for path in sorted((self.dir / "rejected").glob("*.json")):
            data = json.loads(path.read_text())
            out.append((SpoolEntry.model_validate(data["entry"]), data["why"]))
        return out


Deliver = Callable[[SpoolEntry], None]
OnDelivered = Callable[[SpoolEntry], None]


class Deliverer:
    """Background thread that drains a `Spool` in order through `deliver`.

    `deliver(entry)` returns on success, raises `TransientDeliveryError` to retry later or
    `RejectedDeliveryError` to set the entry aside. `kick()` wakes it after an append;
    `flush(timeout)` waits until the spool is empty.
    """

    def __init__(
        self,
        spool: Spool,
        deliver: Deliver,
        *,
        on_delivered: OnDelivered | None = None,
        backoff_s: tuple[float, float] = (0.2, 5.0),
    ) -> None:
        self.spool = spool
        self._deliver = deliver
        self._on_delivered = on_delivered
        self._backoff = backoff_s
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_file: Any = None
        self.last_error: str | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"pinned-eval-spool-{self.spool.dir.name}", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def flush(self, timeout: float) -> bool:
        """Wait until every entry is delivered (or rejected); False on timeout."""
        deadline = time.monotonic() + timeout
        self.kick()
        with self._idle:
            while self.spool.pending():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.2))
        return True

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _acquire_dir(self) -> bool:
        if self._lock_file is None:
            self._lock_file = open(self.spool.dir / ".lock", "a")  # noqa: SIM115 - held for the thread's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _run(self) -> None:
        delay = self._backoff[0]
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before the pass, so a kick during it is not lost
                if not self._acquire_dir():
                    self._wake.wait(1.0)
                    continue
                progressed = self.deliver_pending()
                with self._idle:
                    self._idle.notify_all()
                if progressed:
                    delay = self._backoff[0]
                    self._wake.wait(1.0)
                else:  # transient failure: back off, keep order
                    self._stop.wait(delay)
                    delay = min(delay * 2, self._backoff[1])
        finally:
            if self._lock_file is not None:
                fcntl.flock(self._lock_file, fcntl.LOCK_UN)
                self._lock_file.close()
                self._lock_file = None

    def deliver_pending(self) -> bool:
        """One in-order pass; False if it stopped at a transient failure."""
        for entry in self.spool.pending():
            if self._stop.is_set():
                return True
            try:
                self._deliver(entry)
            except TransientDeliveryError as exc:
                if self.last_error != str(exc):
                    log.warning(
                        "pinned-eval: spooled %s for step %d not delivered yet: %s", entry.kind, entry.step, exc
                    )
                self.last_error = str(exc)
                return False
            except RejectedDeliveryError as exc:
                log.error("pinned-eval: %s for step %d rejected: %s", entry.kind, entry.step, exc)
                self.spool.reject(entry, str(exc))
                continue
            self.last_error = None
            self.spool.remove(entry)
            if self._on_delivered is not None:
                self._on_delivered(entry)
        return True
