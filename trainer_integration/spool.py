"""A local durable spool of requests to the orchestrator, delivered in order by one thread.

Contract:
- `Spool.append(entry)` is the write-ahead step of every request: the entry is written to a temp
  file, fsync'd, renamed to `<seq:012d>.json` and the directory fsync'd before it returns, so an
  acknowledged entry survives a crash of the trainer or the host;
- sequence numbers are taken, and the entry written, under an exclusive `flock` on `.seq.lock`
  (the next number is one past both the `.seq` counter and every entry in the directory), so
  any number of processes appending to one directory never reuse a number (nothing is
  overwritten, nothing lost); a write that fails (a full disk) raises `SpoolWriteError` (an
  `OSError`) and leaves no half-written entry;
- an entry that does not parse, or is of a newer format (`version` above `SPOOL_VERSION`), is
  moved to `quarantine/` (with a `.why` beside it) and logged; reading and delivery go on;
- entries are delivered strictly in sequence order; an entry is deleted only after its delivery
  succeeded (2xx); a transient failure (API unreachable, 5xx, 429) stops the pass and is retried
  with backoff, so nothing is reordered or lost; a permanent rejection (another 4xx) moves the
  entry to `rejected/` with the reason, so one bad entry cannot block the rest; an error of the
  spool's own disk during a pass (a full disk while setting an entry aside) is retried with the
  same backoff, never ends the delivery thread;
- an unexpected error anywhere in delivery never ends the delivery thread either: an exception
  `deliver` raises that is neither transient nor a rejection (a bug, a malformed answer) is logged
  with its traceback and retried with the same backoff, in order; after `unexpected_attempts`
  such failures in a row the entry is quarantined (with the error as its `.why`) and delivery goes
  on with the next one; an error of `on_delivered` is logged and the pass goes on (the entry was
  delivered); any other error of a pass is logged and retried with backoff;
- exactly once comes from the receiver: every entry carries an idempotency key (the event id,
  uuid5 of run and step, or a flow-run idempotency key), so a redelivery after a lost 2xx is one
  point on the server;
- one spool directory has one deliverer at a time (an exclusive `flock` on `.lock`); a second
  process on the same directory appends but does not deliver until the first releases it.
No Prefect import.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)
SPOOL_VERSION: Literal[1] = 1
QUARANTINE = "quarantine"


class SpoolEntry(BaseModel):
    """One request: an event to send, or a flow run to create (a trainer-side skip record)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = Field(default=SPOOL_VERSION, description="Entry format; a newer one is quarantined.")
    kind: Literal["event", "skip_record", "run_request"]
    run: str
    step: int = Field(ge=0)
    key: str = Field(min_length=1, description="Idempotency key on the receiver.")
    body: dict[str, Any]
    seq: int | None = Field(default=None, description="Spool sequence number once appended.")


class UnsupportedEntryError(Exception):
    """A spool entry written in a format newer than this reader's."""


class SpoolWriteError(OSError):
    """An entry could not be written (a full disk, a read-only spool): the request was not spooled."""


def _seq_of(path: Path) -> int:
    stem = path.name.split(".", 1)[0]
    return int(stem) if stem.isdigit() else 0


def _parse(raw: bytes) -> SpoolEntry:
    data = json.loads(raw)  # ValueError (JSONDecodeError, UnicodeDecodeError) when corrupt
    version = data.get("version", 1) if isinstance(data, dict) else 1
    if isinstance(version, int) and version > SPOOL_VERSION:
        raise UnsupportedEntryError(f"format version {version} is newer than this reader's {SPOOL_VERSION}")
    return SpoolEntry.model_validate(data)


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
        (self.dir / QUARANTINE).mkdir(exist_ok=True)
        self._lock = threading.Lock()
        self._seq_file: Any = None

    def append(self, entry: SpoolEntry) -> SpoolEntry:
        """Durably append `entry`; returns it with its sequence number."""
        tmp: str | None = None
        try:
            with self._lock, self._seq_lock():
                seq = self._take_seq()
                stored = entry.model_copy(update={"seq": seq})
                fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".json")
                with os.fdopen(fd, "w") as f:
                    f.write(stored.model_dump_json())
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.dir / f"{seq:012d}.json")
                tmp = None
                _fsync_dir(self.dir)
                return stored
        except OSError as exc:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            raise SpoolWriteError(exc.errno, f"spool {self.dir}: {entry.kind} for step {entry.step} not written: "
                                  f"{exc.strerror or exc}") from exc

    @contextlib.contextmanager
    def _seq_lock(self) -> Iterator[None]:
        """Exclusive across processes (flock) and, with `self._lock`, across this process's threads."""
        if self._seq_file is None:
            self._seq_file = open(self.dir / ".seq.lock", "a")  # noqa: SIM115 - held for the spool's life
        fcntl.flock(self._seq_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._seq_file, fcntl.LOCK_UN)

    def _take_seq(self) -> int:
        """Under the lock: one past the counter and every entry here; the counter records it."""
        counter = self.dir / ".seq"
        try:
            last = int(counter.read_text())
        except (FileNotFoundError, ValueError):  # first use, or a counter lost in a crash
            last = max((_seq_of(p) for d in (self.dir / "rejected", self.dir / QUARANTINE) for p in d.glob("*.json")),
                       default=0)
        seq = max([last, *(_seq_of(p) for p in self.dir.glob("[0-9]*.json"))]) + 1
        tmp = self.dir / ".seq.tmp"
        tmp.write_text(str(seq))
        os.replace(tmp, counter)  # made durable by the directory fsync after the entry's rename
        return seq

    def pending(self) -> list[SpoolEntry]:
        """Every readable entry, oldest first; unreadable or newer-format ones are quarantined."""
        entries = []
        for path in sorted(self.dir.glob("[0-9]*.json")):
            try:
                raw = path.read_bytes()
            except FileNotFoundError:  # delivered and removed by the deliverer meanwhile
                continue
            try:
                entries.append(_parse(raw))
            except (ValueError, RecursionError, UnsupportedEntryError) as exc:  # ValidationError is a ValueError
                self._quarantine(path, f"{type(exc).__name__}: {exc}")
        return entries

    def depth(self) -> int:
        """Entries waiting for delivery (counted by name, nothing read: cheap enough for a scrape)."""
        return sum(1 for _ in self.dir.glob("[0-9]*.json"))

    def _quarantine(self, path: Path, why: str) -> None:
        dest = self.dir / QUARANTINE / path.name
        try:
            os.replace(path, dest)
        except FileNotFoundError:  # another reader quarantined it first
            return
        log.error("pinned-eval: spool entry %s quarantined to %s: %s", path.name, dest, why[:500])
        try:
            dest.with_name(path.name + ".why").write_text(why)
            _fsync_dir(self.dir)
        except OSError as exc:  # the entry is aside already; only the note is missing
            log.warning("pinned-eval: quarantine note for %s not written: %s", path.name, exc)

    def quarantined(self) -> list[tuple[str, str]]:
        """(file name, why) of every entry set aside as unreadable."""
        out = []
        for path in sorted((self.dir / QUARANTINE).glob("*.json")):
            note = path.with_name(path.name + ".why")
            out.append((path.name, note.read_text() if note.exists() else ""))
        return out

    def quarantine(self, entry: SpoolEntry, why: str) -> None:
        """Set a pending entry aside in `quarantine/` with `why` (delivery goes on without it)."""
        self._quarantine(self.dir / f"{entry.seq:012d}.json", why)

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
    `flush(timeout)` waits until the spool is empty. After a transient failure it waits
    `backoff_s[0]`, doubling per failed pass up to exactly `backoff_s[1]` (the cap), and starts
    again from `backoff_s[0]` after a pass that left nothing pending. Any other exception of
    `deliver` is retried the same way and, after `unexpected_attempts` in a row for one entry,
    that entry is quarantined; no exception ends the thread (only `stop()` does).
    """

    def __init__(
        self,
        spool: Spool,
        deliver: Deliver,
        *,
        on_delivered: OnDelivered | None = None,
        backoff_s: tuple[float, float] = (0.2, 5.0),
        unexpected_attempts: int = 3,
    ) -> None:
        if not 0 < backoff_s[0] <= backoff_s[1]:
            raise ValueError(f"backoff_s: need 0 < first <= cap, got {backoff_s}")
        if unexpected_attempts < 1:
            raise ValueError(f"unexpected_attempts: need >= 1, got {unexpected_attempts}")
        self.spool = spool
        self._deliver = deliver
        self._on_delivered = on_delivered
        self._backoff = backoff_s
        self._unexpected_attempts = unexpected_attempts
        self._failures: dict[int | None, int] = {}  # seq -> unexpected failures in a row
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
                try:
                    if not self._acquire_dir():
                        self._wake.wait(1.0)
                        continue
                    progressed = self.deliver_pending()
                except OSError as exc:  # the spool's own disk (full, read-only): keep the thread, retry
                    log.warning("pinned-eval: spool %s: delivery pass failed on the spool itself: %s",
                                self.spool.dir, exc)
                    progressed = False
                except Exception:  # a bug anywhere in a pass: never end the thread, retry with backoff
                    log.exception("pinned-eval: spool %s: delivery pass failed unexpectedly", self.spool.dir)
                    progressed = False
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
            except Exception as exc:  # neither transient nor a rejection: a bug, a malformed answer
                if self._failed_unexpectedly(entry, exc):
                    continue
                return False
            self._failures.pop(entry.seq, None)
            self.last_error = None
            self.spool.remove(entry)
            if self._on_delivered is not None:
                try:
                    self._on_delivered(entry)
                except Exception:  # the entry is delivered; the callback's bug is not delivery's
                    log.exception("pinned-eval: on_delivered failed for %s step %d", entry.kind, entry.step)
        return True

    def _failed_unexpectedly(self, entry: SpoolEntry, exc: Exception) -> bool:
        """Log `exc`; True when `entry` has now failed `unexpected_attempts` times and is quarantined."""
        n = self._failures.get(entry.seq, 0) + 1
        why = f"{type(exc).__name__}: {exc}"
        log.error("pinned-eval: spooled %s for step %d failed unexpectedly (attempt %d of %d): %s",
                  entry.kind, entry.step, n, self._unexpected_attempts, why, exc_info=exc)
        self.last_error = why
        if n < self._unexpected_attempts:
            self._failures[entry.seq] = n
            return False
        self._failures.pop(entry.seq, None)
        self.spool.quarantine(entry, f"delivery failed {n} times: {why}")
        return True
