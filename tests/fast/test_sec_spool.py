"""The trainer's spool: nothing lost to a second process, to a bad entry, or to a runaway backoff.

Real processes on one spool directory, real files; the delivery side is the spool's own
`Deliverer` with a recording `deliver` (no network needed to judge order and loss).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pinned_eval.points import SnapshotSource
from tests.conftest import free_port
from trainer_integration.client import EvalClient
from trainer_integration.spool import Deliverer, Spool, SpoolEntry, TransientDeliveryError

N = 40
_APPENDER = """
import sys
from trainer_integration.spool import Spool, SpoolEntry
spool = Spool(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
for i in range(int(sys.argv[3])):
    spool.append(SpoolEntry(kind="event", run="exp1", step=i, key=f"{sys.argv[2]}-{i}", body={"i": i}))
print("done", flush=True)
"""


def _entry(step: int, key: str) -> SpoolEntry:
    return SpoolEntry(kind="event", run="exp1", step=step, key=key, body={})


def test_two_processes_appending_to_one_spool_lose_nothing(tmp_path: Path) -> None:
    """Both open the spool before either appends (as two trainer processes of one run would)."""
    spool_dir = tmp_path / "spool"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [
        subprocess.Popen([sys.executable, "-c", _APPENDER, str(spool_dir), name, str(N)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
        for name in ("a", "b")
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:  # go: both append at once
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.close()
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    pending = Spool(spool_dir).pending()
    assert sorted(e.key for e in pending) == sorted(f"{n}-{i}" for n in "ab" for i in range(N))
    assert [e.seq for e in pending] == list(range(1, 2 * N + 1))
    for name in "ab":  # each process's own entries keep their order
        assert [e.step for e in pending if e.key.startswith(name)] == list(range(N))


def test_two_spools_on_one_directory_have_one_deliverer_at_a_time(tmp_path: Path) -> None:
    """Two trainer processes' spools on one directory: the second deliverer waits for the first's
    exclusive `.lock`; every entry is delivered exactly once, in order."""
    spool_dir = tmp_path / "s"
    for i in (1, 2, 3):
        Spool(spool_dir).append(_entry(i, f"k{i}"))
    delivered: list[tuple[str, str]] = []
    inside, release = threading.Event(), threading.Event()

    def first(entry: SpoolEntry) -> None:
        delivered.append(("first", entry.key))
        if entry.key == "k1":  # hold the first pass open, as a slow API would
            inside.set()
            assert release.wait(20)

    a = Deliverer(Spool(spool_dir), first, backoff_s=(0.05, 0.1))
    b = Deliverer(Spool(spool_dir), lambda e: delivered.append(("second", e.key)), backoff_s=(0.05, 0.1))
    a.start()
    try:
        assert inside.wait(20)
        assert b._acquire_dir() is False  # the directory is the first deliverer's
        b.start()  # it keeps trying, and delivers nothing while the first holds the lock
        release.set()
        assert a.flush(20)
    finally:
        release.set()
        a.stop()
    try:
        b.spool.append(_entry(4, "k4"))
        b.kick()
        assert b.flush(20)  # the first released the lock when it stopped
    finally:
        b.stop()
    assert delivered == [("first", "k1"), ("first", "k2"), ("first", "k3"), ("second", "k4")]


def test_corrupt_and_newer_format_entries_are_quarantined_and_delivery_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "s")
    for i in (1, 2, 3):
        spool.append(_entry(i, f"k{i}"))
    (tmp_path / "s" / "000000000002.json").write_bytes(b'{"kind": "event", "run": "exp1", "st')  # torn/corrupt
    newer = {**_entry(4, "k4").model_dump(mode="json"), "seq": 4, "version": 2, "priority": "high"}
    (tmp_path / "s" / "000000000004.json").write_text(json.dumps(newer))
    assert spool.append(_entry(5, "k5")).seq == 5
    delivered: list[str] = []
    deliverer = Deliverer(spool, lambda e: delivered.append(e.key), backoff_s=(0.05, 0.1))
    with caplog.at_level(logging.ERROR, logger="trainer_integration.spool"):
        deliverer.start()
        try:
            assert deliverer.flush(20)
        finally:
            deliverer.stop()
    assert delivered == ["k1", "k3", "k5"]
    assert spool.pending() == []
    [(corrupt, why_corrupt), (newer_name, why_newer)] = spool.quarantined()
    assert corrupt == "000000000002.json" and why_corrupt.startswith("JSONDecodeError: ")
    assert newer_name == "000000000004.json"
    assert why_newer == "UnsupportedEntryError: format version 2 is newer than this reader's 1"
    logged = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(logged) == 2 and all(str(tmp_path / "s" / "quarantine") in m for m in logged)
    assert spool.append(_entry(6, "k6")).seq == 6  # numbers are never reused, quarantined ones included


def test_dispatch_goes_on_with_a_corrupt_entry_in_the_spool(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool" / "exp42"
    spool_dir.mkdir(parents=True)
    (spool_dir / "000000000001.json").write_bytes(b"\xff\xfe not an entry")
    dead = f"http://127.0.0.1:{free_port()}/api"
    source = SnapshotSource(kind="hf", path="/ckpt/step_7", require_marker=False)
    with EvalClient("exp42", dead, spool_dir=tmp_path / "spool", startup_sync_s=5) as client:
        assert client.dispatch(3, source=source).action == "requested"
        assert [e.step for e in client.spool.pending()] == [3]
        assert [name for name, _ in client.spool.quarantined()] == ["000000000001.json"]


class _RecordingStop(threading.Event):
    """The deliverer's stop event: records each backoff wait, returns at once, stops after `n`."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.waits = n, []  # type: ignore[var-annotated]

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        if len(self.waits) >= self.n:
            self.set()
        return self.is_set()


def test_retry_backoff_doubles_up_to_exactly_its_cap(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1, "k1"))

    def unreachable(entry: SpoolEntry) -> None:
        raise TransientDeliveryError("connection refused")

    deliverer = Deliverer(spool, unreachable, backoff_s=(0.1, 0.5))
    stop = _RecordingStop(8)
    deliverer._stop = stop
    deliverer._run()  # in this thread: every pass fails, each wait is recorded
    assert stop.waits == [0.1, 0.2, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert [e.key for e in spool.pending()] == ["k1"]  # kept for later, in order


@pytest.mark.parametrize("backoff", [(0.0, 1.0), (2.0, 1.0), (-1.0, 5.0)])
def test_backoff_must_be_positive_and_capped_above_its_start(tmp_path: Path, backoff: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match=r"^backoff_s: need 0 < first <= cap"):
        Deliverer(Spool(tmp_path / "s"), lambda e: None, backoff_s=backoff)
