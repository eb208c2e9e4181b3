"""The trainer's spool (trainer_integration/spool.py), function by function.

Exact file names, counters, file contents, log lines and waits: the tests written to kill the
mutants `make mutants` makes of the spool (docs/testing.md). Real files under tmp_path; the
deliverer runs on the test's thread, its `_stop` / `_wake` / `_idle` waits replaced by recorders
that return at once and its clock by a counter the recorders advance, so every wait and every
backoff is an exact value, never a duration.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

import trainer_integration.spool as spool_mod
from trainer_integration.spool import (
    Deliverer,
    RejectedDeliveryError,
    Spool,
    SpoolEntry,
    SpoolWriteError,
    TransientDeliveryError,
    UnsupportedEntryError,
    _parse,
    _seq_of,
)

LOGGER = "trainer_integration.spool"


def _entry(step: int, key: str = "", kind: str = "event") -> SpoolEntry:
    return SpoolEntry(kind=kind, run="exp1", step=step, key=key or f"k{step}", body={"step": step})  # type: ignore[arg-type]


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---- entries and sequence numbers ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "seq"),
    [("000000000012.json", 12), ("000000000012.json.why", 12), (".tmp-abc.json", 0), ("12a.json", 0), ("7", 7)],
)
def test_a_files_sequence_number_is_its_name_before_the_first_dot(name: str, seq: int) -> None:
    assert _seq_of(Path("/s") / name) == seq


def test_an_entry_without_a_version_is_version_1_and_a_newer_one_is_unsupported() -> None:
    body = {"kind": "event", "run": "exp1", "step": 1, "key": "k", "body": {}}
    assert _parse(json.dumps(body).encode()) == SpoolEntry(kind="event", run="exp1", step=1, key="k", body={})
    assert _parse(json.dumps({**body, "version": 1}).encode()).version == 1
    with pytest.raises(UnsupportedEntryError) as err:
        _parse(json.dumps({**body, "version": 2}).encode())
    assert str(err.value) == "format version 2 is newer than this reader's 1"


@pytest.mark.parametrize("raw", [b"[]", b'{"kind": "event", "version": "2"}', b'"text"'])
def test_a_non_object_or_a_non_integer_version_is_invalid_not_newer(raw: bytes) -> None:
    with pytest.raises(ValidationError):
        _parse(raw)


def test_a_new_spool_makes_its_directories(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "a" / "b")
    assert spool.dir == tmp_path / "a" / "b"
    assert _names(spool.dir) == ["quarantine", "rejected"]
    Spool(tmp_path / "a" / "b")  # reopening an existing spool is fine
    assert spool.pending() == [] and spool.quarantined() == [] and spool.rejected() == []


def test_append_writes_one_file_per_entry_named_by_its_number_and_leaves_no_temp(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    first = spool.append(_entry(5))
    assert first == _entry(5).model_copy(update={"seq": 1})
    fds = _fds()  # the lock file is open from the first append on, for the spool's life
    second = spool.append(_entry(6))
    assert _fds() == fds  # nothing else is left open
    assert second.seq == 2
    assert _names(spool.dir) == [".seq", ".seq.lock", "000000000001.json", "000000000002.json", "quarantine",
                                 "rejected"]
    assert (spool.dir / "000000000002.json").read_text() == second.model_dump_json()
    assert (spool.dir / ".seq").read_text() == "2"
    assert spool.pending() == [first, second]


def test_the_entry_is_written_to_a_hidden_temp_file_then_renamed(tmp_path: Path, monkeypatch) -> None:
    spool = Spool(tmp_path / "s")
    renames: list[tuple[str, str]] = []
    real = os.replace

    def recording(src: Any, dst: Any) -> None:
        renames.append((str(src), str(dst)))
        real(src, dst)

    monkeypatch.setattr(spool_mod.os, "replace", recording)
    spool.append(_entry(1))
    [(seq_src, seq_dst), (src, dst)] = renames
    assert (seq_src, seq_dst) == (str(spool.dir / ".seq.tmp"), str(spool.dir / ".seq"))
    assert Path(src).parent == spool.dir and Path(src).name.startswith(".tmp-") and src.endswith(".json")
    assert dst == str(spool.dir / "000000000001.json")


@pytest.mark.parametrize(
    ("error", "shown"),
    [(OSError(errno.ENOSPC, "No space left on device"), "No space left on device"), (OSError("boom"), "boom")],
)
def test_a_failed_write_raises_spool_write_error_and_leaves_no_half_entry(
    tmp_path: Path, monkeypatch, error: OSError, shown: str
) -> None:
    spool = Spool(tmp_path / "s")
    real = os.replace

    def full_disk(src: Any, dst: Any) -> None:
        if str(dst).endswith(".json"):
            raise error
        real(src, dst)

    monkeypatch.setattr(spool_mod.os, "replace", full_disk)
    with pytest.raises(SpoolWriteError) as err:
        spool.append(_entry(3, kind="skip_record"))
    assert err.value.errno == error.errno
    assert err.value.strerror == f"spool {spool.dir}: skip_record for step 3 not written: {shown}"
    assert isinstance(err.value.__cause__, OSError)
    assert _names(spool.dir) == [".seq", ".seq.lock", "quarantine", "rejected"]  # the temp file is gone
    monkeypatch.setattr(spool_mod.os, "replace", real)
    assert spool.append(_entry(4)).seq == 2  # a number once taken is never reused


def test_a_temp_file_already_gone_does_not_hide_the_write_error(tmp_path: Path, monkeypatch) -> None:
    spool = Spool(tmp_path / "s")
    real = os.replace

    def vanished(src: Any, dst: Any) -> None:
        if str(dst).endswith(".json"):
            os.unlink(src)
            raise OSError(errno.EIO, "I/O error")
        real(src, dst)

    monkeypatch.setattr(spool_mod.os, "replace", vanished)
    with pytest.raises(SpoolWriteError) as err:
        spool.append(_entry(3))
    assert err.value.errno == errno.EIO


def test_numbers_follow_the_counter_and_every_entry_here(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    (spool.dir / ".seq").write_text("10")
    (spool.dir / "000000000004.json").write_text(_entry(4).model_dump_json())
    assert spool.append(_entry(1)).seq == 11  # one past the counter
    (spool.dir / "000000000030.json").write_text(_entry(30).model_dump_json())
    assert spool.append(_entry(2)).seq == 31  # one past the newest entry
    assert (spool.dir / ".seq").read_text() == "31"
    assert not (spool.dir / ".seq.tmp").exists()


@pytest.mark.parametrize("counter", [None, "not a number"])
@pytest.mark.parametrize(("rejected", "quarantined"), [(3, 7), (9, 7)])
def test_a_lost_counter_restarts_past_rejected_and_quarantined_entries(
    tmp_path: Path, counter: str | None, rejected: int, quarantined: int
) -> None:
    spool = Spool(tmp_path / "s")
    (spool.dir / "rejected" / f"{rejected:012d}.json").write_text("{}")
    (spool.dir / "quarantine" / f"{quarantined:012d}.json").write_text("{}")
    if counter is not None:
        (spool.dir / ".seq").write_text(counter)
    assert spool.append(_entry(1)).seq == max(rejected, quarantined) + 1
    fresh = Spool(tmp_path / "fresh")
    assert fresh.append(_entry(1)).seq == 1


# ---- reading, quarantine, rejects ------------------------------------------------------------------


def test_pending_is_oldest_first_and_ignores_temp_files(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    for seq in (12, 3, 7):
        (spool.dir / f"{seq:012d}.json").write_text(_entry(seq).model_copy(update={"seq": seq}).model_dump_json())
    (spool.dir / ".tmp-abc.json").write_text("half")
    assert [e.seq for e in spool.pending()] == [3, 7, 12]
    assert spool.quarantined() == []


def test_an_entry_delivered_while_reading_is_skipped_and_the_rest_read(tmp_path: Path, monkeypatch) -> None:
    spool = Spool(tmp_path / "s")
    for step in (1, 2, 3):
        spool.append(_entry(step))
    real = Path.read_bytes

    def racing(self: Path) -> bytes:
        if self.name == "000000000001.json":
            raise FileNotFoundError(self)  # removed by the deliverer between the listing and the read
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", racing)
    assert [e.step for e in spool.pending()] == [2, 3]
    assert spool.quarantined() == []


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "RecursionError: "),
        (b'{"kind": "event"}', "ValidationError: "),
        (b'{"a": "\xff"}', "UnicodeDecodeError: "),
    ],
)
def test_unreadable_entries_are_quarantined_with_their_reason(tmp_path: Path, raw: bytes, why: str) -> None:
    spool = Spool(tmp_path / "s")
    (spool.dir / "000000000001.json").write_bytes(raw)
    spool.append(_entry(2))
    assert [e.step for e in spool.pending()] == [2]
    [(name, note)] = spool.quarantined()
    assert name == "000000000001.json" and note.startswith(why)
    assert (spool.dir / "quarantine" / name).read_bytes() == raw


def test_quarantine_logs_the_first_500_characters_and_keeps_the_whole_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "s")
    path = spool.dir / "000000000001.json"
    path.write_text("x")
    why = "a" * 500 + "b" * 100
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        spool._quarantine(path, why)
        spool._quarantine(path, why)  # quarantined already (by another reader): nothing more
    dest = spool.dir / "quarantine" / "000000000001.json"
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER] == [
        (logging.ERROR, f"pinned-eval: spool entry 000000000001.json quarantined to {dest}: {'a' * 500}")
    ]
    assert spool.quarantined() == [("000000000001.json", why)]
    assert not path.exists()


def test_a_quarantine_note_that_cannot_be_written_is_a_warning_and_the_entry_stays_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "s")
    path = spool.dir / "000000000001.json"
    path.write_text("x")
    note = spool.dir / "quarantine" / "000000000001.json.why"
    note.mkdir()  # writing the note fails: IsADirectoryError
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        spool._quarantine(path, "why")
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER][1:] == [
        (logging.WARNING, f"pinned-eval: quarantine note for 000000000001.json not written: "
                          f"[Errno 21] Is a directory: '{note}'")
    ]
    assert (spool.dir / "quarantine" / "000000000001.json").read_text() == "x"


def test_a_quarantined_entry_without_its_note_reads_as_an_empty_reason(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    (spool.dir / "000000000001.json").write_text("{")
    (spool.dir / "000000000002.json").write_text("}")
    assert spool.pending() == []
    (spool.dir / "quarantine" / "000000000001.json.why").unlink()
    [(first, why1), (second, why2)] = spool.quarantined()
    assert (first, why1) == ("000000000001.json", "")
    assert second == "000000000002.json" and why2.startswith("JSONDecodeError: ")


def test_remove_deletes_the_entry_and_tolerates_one_already_gone(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    a, b = spool.append(_entry(1)), spool.append(_entry(2))
    spool.remove(a)
    spool.remove(a)
    assert spool.pending() == [b]


def test_a_rejected_entry_moves_aside_with_its_reason(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    a, b = spool.append(_entry(1)), spool.append(_entry(2))
    spool.reject(a, "422: bad step")
    assert json.loads((spool.dir / "rejected" / "000000000001.json").read_text()) == {
        "entry": a.model_dump(mode="json"), "why": "422: bad step"
    }
    assert spool.pending() == [b]
    assert spool.rejected() == [(a, "422: bad step")]
    spool.remove(b)
    spool.reject(b, "gone already")  # its file was removed meanwhile: still recorded, no error
    assert spool.rejected() == [(a, "422: bad step"), (b, "gone already")]


def test_a_rejected_entry_is_kept_in_json_whatever_its_body_holds(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    entry = spool.append(SpoolEntry(kind="event", run="exp1", step=1, key="k1",
                                    body={"at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), "pair": (1, 2)}))
    spool.reject(entry, "400")
    stored = json.loads((spool.dir / "rejected" / "000000000001.json").read_text())
    assert stored["entry"]["body"] == {"at": "2026-01-02T03:04:05Z", "pair": [1, 2]}
    assert json.loads((spool.dir / "rejected" / "000000000001.json").read_text())["entry"] == json.loads(
        entry.model_dump_json())  # as the spool wrote it


# ---- the deliverer ------------------------------------------------------------------------------------


class _Clock:
    """The spool module's `time`, advanced only by the recorders below."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _Waits:
    """One log of every wait the deliverer makes: (which, timeout); stops it after `limit` waits."""

    def __init__(self, deliverer: Deliverer, limit: int, clock: _Clock | None = None, step: float = 0.0) -> None:
        self.log: list[tuple[str, float | None]] = []
        self.deliverer, self.limit, self.clock, self.step = deliverer, limit, clock, step

    def record(self, which: str, timeout: float | None) -> None:
        self.log.append((which, timeout))
        if self.clock is not None:
            self.clock.now += self.step
        if len(self.log) >= self.limit:
            threading.Event.set(self.deliverer._stop)
        assert len(self.log) < self.limit + 50, "the deliverer kept waiting after it was told to stop"


class _RecordingEvent(threading.Event):
    def __init__(self, waits: _Waits, which: str) -> None:
        super().__init__()
        self.waits, self.which = waits, which

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.record(self.which, timeout)
        return self.is_set()


class _RecordingCondition(threading.Condition):
    def __init__(self, waits: _Waits) -> None:
        super().__init__()
        self.waits = waits

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.record("idle", timeout)
        return False


def _recorded(deliverer: Deliverer, limit: int) -> _Waits:
    waits = _Waits(deliverer, limit)
    deliverer._stop = _RecordingEvent(waits, "stop")
    deliverer._wake = _RecordingEvent(waits, "wake")
    return waits


def test_backoff_must_be_positive_and_capped_above_its_start_exact_message(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        Deliverer(Spool(tmp_path / "s"), lambda e: None, backoff_s=(0.0, 1.0))
    assert str(err.value) == "backoff_s: need 0 < first <= cap, got (0.0, 1.0)"
    Deliverer(Spool(tmp_path / "s"), lambda e: None, backoff_s=(0.5, 0.5))  # first == cap is allowed


def test_the_default_backoff_starts_at_0_2_s_and_is_capped_at_5_s(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1))

    def unreachable(entry: SpoolEntry) -> None:
        raise TransientDeliveryError("connection refused")

    deliverer = Deliverer(spool, unreachable)
    assert deliverer.last_error is None
    waits = _recorded(deliverer, 8)
    deliverer._run()
    assert waits.log == [("stop", w) for w in (0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0)]
    assert deliverer.last_error == "connection refused"


def test_a_pass_that_delivers_waits_for_a_kick_and_resets_the_backoff(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1))
    answers = iter(["down", "down", "ok", "down"])
    delivered: list[int] = []

    def flaky(entry: SpoolEntry) -> None:
        if next(answers) == "down":
            raise TransientDeliveryError("503")
        delivered.append(entry.step)
        spool.append(_entry(entry.step + 1))  # the trainer appended meanwhile: the next pass has one

    deliverer = Deliverer(spool, flaky, backoff_s=(0.25, 4.0))
    waits = _recorded(deliverer, 4)
    deliverer._run()
    assert waits.log == [("stop", 0.25), ("stop", 0.5), ("wake", 1.0), ("stop", 0.25)]
    assert delivered == [1]
    assert [e.step for e in spool.pending()] == [2]


def test_a_deliverer_waits_while_another_holds_the_directory_and_delivers_nothing(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1))
    holder = Deliverer(Spool(tmp_path / "s"), lambda e: None)
    assert holder._acquire_dir() is True
    assert holder._acquire_dir() is True  # its own lock, asked again
    delivered: list[SpoolEntry] = []
    other = Deliverer(spool, delivered.append)
    waits = _recorded(other, 3)
    other._run()
    assert waits.log == [("wake", 1.0)] * 3
    assert delivered == [] and other._lock_file is None  # closed when its thread ends
    assert (spool.dir / ".lock").exists()


def test_the_directory_lock_is_released_when_the_thread_ends(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    first = Deliverer(spool, lambda e: None)
    _recorded(first, 1)
    first._run()
    assert first._lock_file is None
    assert Deliverer(Spool(tmp_path / "s"), lambda e: None)._acquire_dir() is True


def test_a_spool_disk_error_during_a_pass_is_logged_and_retried_with_backoff(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1))
    os.rmdir(spool.dir / "rejected")
    (spool.dir / "rejected").write_text("")  # setting the entry aside fails: NotADirectoryError

    def refuse(entry: SpoolEntry) -> None:
        raise RejectedDeliveryError("400")

    deliverer = Deliverer(spool, refuse, backoff_s=(0.5, 1.0))
    waits = _recorded(deliverer, 2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        deliverer._run()
    assert waits.log == [("stop", 0.5), ("stop", 1.0)]
    failed = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert [r.getMessage() for r in failed] == [
        f"pinned-eval: spool {spool.dir}: delivery pass failed on the spool itself: "
        f"[Errno 20] Not a directory: '{spool.dir / 'rejected' / '000000000001.json'}'"
    ] * 2
    assert [e.step for e in spool.pending()] == [1]  # nothing lost


def test_a_pass_delivers_in_order_sets_rejects_aside_and_stops_at_a_transient_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "s")
    for step in (1, 2, 3, 4):
        spool.append(_entry(step))
    calls: list[int] = []
    done: list[int] = []

    def deliver(entry: SpoolEntry) -> None:
        calls.append(entry.step)
        if entry.step == 2:
            raise RejectedDeliveryError("422: no such block")
        if entry.step == 4:
            raise TransientDeliveryError("connection refused")

    deliverer = Deliverer(spool, deliver, on_delivered=lambda e: done.append(e.step))
    deliverer.last_error = "earlier"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert deliverer.deliver_pending() is False
        assert deliverer.deliver_pending() is False  # the same error again: not logged again
    assert calls == [1, 2, 3, 4, 4] and done == [1, 3]
    assert [e.step for e in spool.pending()] == [4]
    assert [(e.step, why) for e, why in spool.rejected()] == [(2, "422: no such block")]
    assert deliverer.last_error == "connection refused"
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER] == [
        (logging.ERROR, "pinned-eval: event for step 2 rejected: 422: no such block"),
        (logging.WARNING, "pinned-eval: spooled event for step 4 not delivered yet: connection refused"),
    ]


def test_a_delivery_clears_the_last_error_and_a_new_error_is_logged_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1))
    errors = iter([TransientDeliveryError("503"), None, TransientDeliveryError("503")])

    def deliver(entry: SpoolEntry) -> None:
        exc = next(errors)
        if exc is not None:
            raise exc
        spool.append(_entry(entry.step + 1))

    deliverer = Deliverer(spool, deliver)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert deliverer.deliver_pending() is False
        assert deliverer.deliver_pending() is True  # step 1 delivered (step 2 appended meanwhile)
        assert deliverer.last_error is None
        assert deliverer.deliver_pending() is False  # step 2 failed with the same text: logged, as new
    assert deliverer.last_error == "503"
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "pinned-eval: spooled event for step 1 not delivered yet: 503",
        "pinned-eval: spooled event for step 2 not delivered yet: 503",
    ]


def test_a_stopped_deliverer_delivers_nothing_more(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1))
    delivered: list[SpoolEntry] = []
    deliverer = Deliverer(spool, delivered.append)
    deliverer._stop.set()
    assert deliverer.deliver_pending() is True
    assert delivered == [] and [e.step for e in spool.pending()] == [1]


def test_start_is_idempotent_and_stop_ends_the_named_daemon_thread(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "run-7")
    deliverer = Deliverer(spool, lambda e: None)
    deliverer.start()
    thread = deliverer._thread
    assert thread is not None and thread.daemon and thread.name == "pinned-eval-spool-run-7"
    deliverer.start()
    assert deliverer._thread is thread
    deliverer.stop(timeout=30)
    assert deliverer._thread is None and not thread.is_alive()
    assert deliverer._stop.is_set() and deliverer._wake.is_set()


def test_flush_of_an_empty_spool_kicks_the_deliverer_and_returns_true(tmp_path: Path) -> None:
    deliverer = Deliverer(Spool(tmp_path / "s"), lambda e: None)
    assert deliverer.flush(0.0) is True
    assert deliverer._wake.is_set()


def test_flush_polls_every_0_2_s_until_exactly_its_deadline(tmp_path: Path, monkeypatch) -> None:
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1))
    deliverer = Deliverer(spool, lambda e: None)  # never started: the entry stays pending
    clock = _Clock()
    monkeypatch.setattr(spool_mod, "time", SimpleNamespace(monotonic=clock.monotonic))
    waits = _Waits(deliverer, limit=100, clock=clock, step=0.125)  # each wait advances the clock 1/8 s
    deliverer._idle = _RecordingCondition(waits)
    assert deliverer.flush(0.5) is False
    assert waits.log == [("idle", 0.2), ("idle", 0.2), ("idle", 0.2), ("idle", 0.125)]


def test_stop_waits_at_most_its_timeout_for_a_delivery_in_progress(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1))
    inside, release = threading.Event(), threading.Event()

    def slow(entry: SpoolEntry) -> None:  # an API call that hangs
        inside.set()
        release.wait(10)

    deliverer = Deliverer(spool, slow)
    deliverer.start()
    thread = deliverer._thread
    assert thread is not None and inside.wait(30)
    try:
        deliverer.stop(timeout=0.05)
        assert thread.is_alive()  # stop returned while the delivery still hangs
        assert deliverer._thread is None
    finally:
        release.set()
        thread.join(30)
    assert [e.step for e in spool.pending()] == []  # the delivery in progress completed; nothing lost
