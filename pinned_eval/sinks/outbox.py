"""The outbox: a worker's queue of remote tracker exports, sent off the points' path (no Prefect here).

A point run by `pinned-eval worker` does not wait for W&B or MLflow. `defer` makes each
deferrable exporter's parcel on the point (`Exporter.parcel`: local reads only), writes them as
one `Envelope` into the worker's outbox and returns; the worker's deliverer
(`pinned_eval.sinks.delivery.Deliverer`, a process beside the worker) sends them with the same
retries and locks the point would use, and notes an exporter that still failed in the point's
ledger rows (`sink_errors`, `eval/sink_failed_<name>`), as the point does for the exporters it
runs itself. The ledger row of a point is written before its envelope: the record never waits.

- **Where**: the directory named by `PINNED_EVAL_OUTBOX_DIR` (the stack sets `<home>/outbox` for
  the worker, its flow runs and the deliverer). It must be a 0700 directory of this user, the
  whole path trusted (`pinned_eval.trusted_paths`): a neighbour can neither plant an envelope
  (which names a ledger file the deliverer writes) nor read one (a parcel holds its exporter's
  secrets, e.g. MLflow's token). Anything else is refused and the point exports inline.
- **Served or not**: the deliverer holds an exclusive `flock` on `<outbox>/.deliverer.lock` for
  its life (one deliverer per outbox). A point defers only while that lock is held; otherwise
  nobody would send, so it exports inline, as a point run outside the worker always does.
- **Envelopes**: `<time ns>-<pid>-<n>.json`, mode 0600, written under a temp name then renamed,
  so a deliverer never reads half of one (the temp file of a point killed in between is removed
  by the deliverer once that process is provably gone: `pinned_eval.writer_temps`); sent oldest
  first (by name). One is removed only once each parcel was sent or its failure noted: a
  deliverer that dies in between sends it again at its next start (the tracker may then hold that
  step twice, as after a retry). One that cannot be read is moved to `rejected/`, with a
  warning, never deleted.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.sinks.exporters import Exporter, Parcel, PointRecord
from pinned_eval.trusted_paths import make_private_dir, open_trusted_file
from pinned_eval.writer_temps import sweep_temps, temp_name

log = logging.getLogger(__name__)
OUTBOX_ENV = "PINNED_EVAL_OUTBOX_DIR"
LOCK_FILE = ".deliverer.lock"
REJECTED = "rejected"
MAX_ENVELOPE_BYTES = 64 << 20
_seq = itertools.count()


class Envelope(BaseModel):
    """One point's deferred exports: its parcels, and where its ledger rows are (`ledger`: the
    sinks block's `jsonl_path`) with the flow run that wrote them, for the failure note."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: str
    step: int
    flow_run_id: str | None = None
    ledger: str | None = None
    parcels: list[Parcel]
    posted_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


class Outbox:
    """A worker's outbox directory (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        make_private_dir(str(self.root), "outbox")
        make_private_dir(str(self.root / REJECTED), "outbox")
        self._lock_path = self.root / LOCK_FILE

    @classmethod
    def of_this_worker(cls) -> Outbox | None:
        """The outbox of the worker running this process, when it has one and a deliverer serves
        it; else None (`UntrustedPathError`: the directory is refused)."""
        path = os.environ.get(OUTBOX_ENV)
        if not path:
            return None
        outbox = cls(path)
        return outbox if outbox.served() else None

    def _open_lock(self) -> int:
        return os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)

    def served(self) -> bool:
        """Whether a deliverer holds this outbox now."""
        fd = self._open_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # releases the lock when it was taken: only a test of it
        return False

    @contextmanager
    def serving(self, stop: threading.Event, poll_s: float = 0.2) -> Iterator[bool]:
        """Hold the deliverer lock for the body; yields False when `stop` was set before it was
        free (another deliverer serves this outbox meanwhile)."""
        fd = self._open_lock()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if stop.wait(poll_s):
                        yield False
                        return
            yield True
        finally:
            os.close(fd)

    def post(self, envelope: Envelope) -> Path:
        """Write `envelope` for the deliverer; returns its path."""
        path = self.root / f"{time.time_ns():020d}-{os.getpid()}-{next(_seq)}.json"
        tmp = path.with_name(temp_name(path.name))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(envelope.model_dump_json().encode())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.rename(tmp, path)
        return path

    def sweep(self) -> None:
        """Remove the temp files of posts whose process died before the rename (`writer_temps`)."""
        sweep_temps(self.root, lambda name: log.warning("outbox: removed %s: its point died before posting it", name))

    def pending(self) -> list[Path]:
        """The envelopes waiting, oldest first."""
        return [self.root / name for name in _envelope_names(self.root)]

    def read(self, path: Path) -> Envelope:
        """The envelope at `path` (`ValueError`/`OSError` when it is not one: `reject` it)."""
        fd = open_trusted_file(str(path), "outbox envelope")
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_ENVELOPE_BYTES + 1)
        if len(raw) > MAX_ENVELOPE_BYTES:
            raise ValueError(f"over {MAX_ENVELOPE_BYTES >> 20} MiB")
        return Envelope.model_validate_json(raw)

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def reject(self, path: Path, why: str) -> None:
        """Move an unreadable envelope aside (`rejected/`), kept for an operator."""
        log.warning("outbox: %s is not an envelope, moved to %s/: %s", path, REJECTED, why)
        os.replace(path, self.root / REJECTED / path.name)


def _envelope_names(root: Path) -> list[str]:
    """The names of the envelopes in `root`, oldest first (temp files and `rejected/` left out)."""
    return sorted(name for name in os.listdir(root) if name.endswith(".json") and not name.startswith("."))


def envelopes_waiting(root: str | Path) -> int:
    """How many envelopes wait in the outbox at `root` (names only, nothing read or created; 0
    when it does not exist yet)."""
    try:
        return len(_envelope_names(Path(root)))
    except FileNotFoundError:
        return 0


def defer(
    exporters: Sequence[Exporter], record: PointRecord, ledger: str | None
) -> tuple[list[Exporter], list[str], dict[str, str]]:
    """Send the deferrable `exporters` through this worker's outbox when a deliverer serves it.

    Returns (the exporters to run on the point: all of them when there is no served outbox or
    the envelope cannot be written; the names deferred; {name: error} of those whose parcel could
    not be made, as the ledger notes it)."""
    deferrable = [e for e in exporters if e.deferrable]
    if not deferrable:
        return list(exporters), [], {}
    try:
        outbox = Outbox.of_this_worker()
    except (OSError, ValueError) as exc:  # UntrustedPathError is a ValueError
        log.warning("outbox not used, trackers export on the point: %s", exc)
        return list(exporters), [], {}
    if outbox is None:
        return list(exporters), [], {}
    parcels: list[Parcel] = []
    errors: dict[str, str] = {}
    for exporter in deferrable:
        try:
            parcels.append(exporter.parcel(record))
        except Exception as exc:  # noted beside the point like a failed export, never raised
            errors[exporter.name] = exporter.describe_failure(f"{type(exc).__name__}: {exc}")
    envelope = Envelope(run=record.run, step=record.step, flow_run_id=record.flow_run_id,
                        ledger=os.path.abspath(ledger) if ledger else None, parcels=parcels)
    if parcels:
        try:
            outbox.post(envelope)
        except OSError as exc:
            log.warning("outbox %s: envelope not written, trackers export on the point: %s", outbox.root, exc)
            return list(exporters), [], {}
    inline = [e for e in exporters if not e.deferrable]
    return inline, [p.exporter for p in parcels], errors
