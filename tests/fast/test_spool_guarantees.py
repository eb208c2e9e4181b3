"""The spool's delivery thread cannot die, and two threads of one process never share a number.

Real files under tmp_path, the spool's own `Deliverer` and thread with a recording `deliver`.
The trainer's `dispatch` and the admission thread's run-request fallback append to one `Spool`
object from two threads; an unexpected exception in delivery (a bug, a malformed answer) is
logged, retried, quarantined after `unexpected_attempts`, and delivery goes on.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from trainer_integration.spool import Deliverer, Spool, SpoolEntry, TransientDeliveryError

LOGGER = "trainer_integration.spool"


def _entry(step: int, key: str = "") -> SpoolEntry:
    return SpoolEntry(kind="event", run="exp1", step=step, key=key or f"k{step}", body={"step": step})


def test_an_unexpected_error_mid_delivery_never_stops_the_thread_and_later_entries_are_delivered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2 raises a KeyError every time (quarantined after 3 attempts), step 3 a ValueError once
    (retried, then delivered); steps 1, 3, 4 and one appended afterwards are delivered, in order."""
    spool = Spool(tmp_path / "s")
    for step in (1, 2, 3, 4):
        spool.append(_entry(step))
    calls: list[int] = []
    failed_once: set[int] = set()

    def deliver(entry: SpoolEntry) -> None:
        calls.append(entry.step)
        if entry.step == 2:
            raise KeyError("payload")
        if entry.step == 3 and 3 not in failed_once:
            failed_once.add(3)
            raise ValueError("malformed answer")

    delivered: list[int] = []
    deliverer = Deliverer(spool, deliver, on_delivered=lambda e: delivered.append(e.step), backoff_s=(0.01, 0.01))
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        deliverer.start()
        try:
            assert deliverer.flush(30.0)
            spool.append(_entry(5))  # the thread is still alive: a later append is delivered too
            assert deliverer.flush(30.0)
            assert deliverer._thread is not None and deliverer._thread.is_alive()
        finally:
            deliverer.stop()
    assert delivered == [1, 3, 4, 5]
    assert calls == [1, 2, 2, 2, 3, 3, 4, 5]
    assert deliverer._failures == {}  # counts of quarantined and delivered entries are forgotten
    assert spool.pending() == []
    assert spool.quarantined() == [("000000000002.json", "delivery failed 3 times: KeyError: 'payload'")]
    assert json.loads((spool.dir / "quarantine" / "000000000002.json").read_text())["key"] == "k2"
    errors = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.ERROR]
    assert errors == [
        *(f"pinned-eval: spooled event for step 2 failed unexpectedly (attempt {n} of 3): KeyError: 'payload'"
          for n in (1, 2, 3)),
        "pinned-eval: spool entry 000000000002.json quarantined to "
        f"{spool.dir / 'quarantine' / '000000000002.json'}: delivery failed 3 times: KeyError: 'payload'",
        "pinned-eval: spooled event for step 3 failed unexpectedly (attempt 1 of 3): ValueError: malformed answer",
    ]
    assert all(r.exc_info is not None for r in caplog.records if "failed unexpectedly" in r.getMessage())


def test_unexpected_failures_count_in_a_row_per_entry_and_a_delivery_resets_them(tmp_path: Path) -> None:
    """Two failures, a success, two failures again: never quarantined at `unexpected_attempts=3`."""
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1))
    answers = iter(["bug", "bug", "ok", "bug", "bug"])

    def deliver(entry: SpoolEntry) -> None:
        if next(answers) == "bug":
            raise RuntimeError("bug")
        spool.append(_entry(entry.step + 1))

    deliverer = Deliverer(spool, deliver)
    assert [deliverer.deliver_pending() for _ in range(5)] == [False, False, True, False, False]
    assert deliverer.last_error == "RuntimeError: bug"
    assert [e.step for e in spool.pending()] == [2] and spool.quarantined() == []
    assert deliverer._failures == {2: 2}  # the delivered entry's count is forgotten, not kept forever


def test_with_one_unexpected_attempt_the_entry_is_quarantined_at_once_and_the_pass_goes_on(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    for step in (1, 2):
        spool.append(_entry(step))
    delivered: list[int] = []

    def deliver(entry: SpoolEntry) -> None:
        if entry.step == 1:
            raise AttributeError("no such field")
        delivered.append(entry.step)

    deliverer = Deliverer(spool, deliver, unexpected_attempts=1)
    assert deliverer.deliver_pending() is True
    assert delivered == [2] and deliverer._failures == {}  # a quarantined entry's count is forgotten
    assert spool.quarantined() == [("000000000001.json", "delivery failed 1 times: AttributeError: no such field")]
    with pytest.raises(ValueError, match=r"^unexpected_attempts: need >= 1, got 0$"):
        Deliverer(spool, deliver, unexpected_attempts=0)


def test_a_failing_on_delivered_is_logged_and_the_pass_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "s")
    for step in (1, 2):
        spool.append(_entry(step))
    delivered: list[int] = []

    def on_delivered(entry: SpoolEntry) -> None:
        delivered.append(entry.step)
        raise RuntimeError("callback bug")

    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert Deliverer(spool, lambda e: None, on_delivered=on_delivered).deliver_pending() is True
    assert delivered == [1, 2] and spool.pending() == []
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "pinned-eval: on_delivered failed for event step 1", "pinned-eval: on_delivered failed for event step 2"
    ]


def test_an_unexpected_error_of_a_whole_pass_is_logged_and_retried_with_backoff(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug outside `deliver` (here reading the spool) is retried with the backoff, never ends the thread."""
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1))
    real_pending = spool.pending
    reads = iter([RuntimeError("bug in pending"), None])

    def pending() -> list[SpoolEntry]:
        exc = next(reads, None)
        if exc is not None:
            raise exc
        return real_pending()

    monkeypatch.setattr(spool, "pending", pending)
    delivered: list[int] = []
    deliverer = Deliverer(spool, lambda e: delivered.append(e.step), backoff_s=(0.5, 1.0))
    waits: list[tuple[str, float | None]] = []

    class Recording(threading.Event):
        def __init__(self, which: str) -> None:
            super().__init__()
            self.which = which

        def wait(self, timeout: float | None = None) -> bool:
            waits.append((self.which, timeout))
            if len(waits) >= 2:
                threading.Event.set(deliverer._stop)
            return self.is_set()

    deliverer._stop, deliverer._wake = Recording("stop"), Recording("wake")
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        deliverer._run()
    assert waits == [("stop", 0.5), ("wake", 1.0)]  # backed off after the failed pass, then delivered
    assert delivered == [1]
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert record.getMessage() == f"pinned-eval: spool {spool.dir}: delivery pass failed unexpectedly"
    assert record.exc_info is not None and str(record.exc_info[1]) == "bug in pending"


def test_a_transient_failure_is_still_retried_forever_never_quarantined(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.append(_entry(1))

    def unreachable(entry: SpoolEntry) -> None:
        raise TransientDeliveryError("connection refused")

    deliverer = Deliverer(spool, unreachable, unexpected_attempts=1)
    assert [deliverer.deliver_pending() for _ in range(3)] == [False] * 3
    assert [e.step for e in spool.pending()] == [1] and spool.quarantined() == []


N_THREADS, N_EACH = 2, 150


def test_two_threads_appending_to_one_spool_lose_nothing_and_never_share_a_number(tmp_path: Path) -> None:
    """The trainer's `dispatch` and the admission thread's fallback append to one `Spool` at once:
    every entry is there, intact, under its own sequence number (the flock alone does not exclude
    two threads sharing its file; the spool's thread lock does)."""
    spool = Spool(tmp_path / "s")
    start = threading.Barrier(N_THREADS)
    got: dict[str, list[int]] = {}

    def append(name: str) -> None:
        start.wait()
        got[name] = [spool.append(_entry(i, f"{name}-{i}")).seq or 0 for i in range(N_EACH)]

    threads = [threading.Thread(target=append, args=(f"t{n}",)) for n in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pending = spool.pending()
    assert spool.quarantined() == []  # nothing corrupt
    assert [e.seq for e in pending] == list(range(1, N_THREADS * N_EACH + 1))
    assert sorted(e.key for e in pending) == sorted(f"t{n}-{i}" for n in range(N_THREADS) for i in range(N_EACH))
    assert sorted(s for seqs in got.values() for s in seqs) == list(range(1, N_THREADS * N_EACH + 1))
    for name, seqs in got.items():  # each thread's own entries keep their order
        assert seqs == sorted(seqs)
        assert [e.step for e in pending if e.key.startswith(name + "-")] == list(range(N_EACH))
    assert (spool.dir / ".seq").read_text() == str(N_THREADS * N_EACH)
