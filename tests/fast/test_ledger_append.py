"""The append-only ledger (`pinned_eval.sinks.ledger`, `ledger_file`): a write appends one framed
group and every reader returns each point's last complete write; files written before the framing
read as they did; concurrent writers (threads, processes) lose and duplicate nothing; a reader never
returns part of a write, in flight or cut short; compaction bounds the file and a crash in it keeps
the old file; a write's bytes do not depend on the file's length."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pinned_eval.sinks import Ledger, MetricRow, ledger_file
from pinned_eval.sinks.ledger_file import locked

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _row(run: str, step: int, value: float, dataset: str | None = "add") -> MetricRow:
    if dataset is None:
        return MetricRow(run=run, step=step, state="skipped", reason="busy", metrics={"eval/skipped_busy": value})
    return MetricRow(run=run, step=step, dataset=dataset, state="measured", metrics={f"eval/{dataset}": value})


def _view(rows: list[MetricRow]) -> list[tuple[str, int, str | None, dict[str, float]]]:
    return [(r.run, r.step, r.dataset, r.metrics) for r in rows]


def test_a_rerun_and_a_note_replace_the_points_rows_for_every_reader(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "m.jsonl")
    led.write_point([_row("a", 1, 0.1), _row("a", 1, 0.2, "sub")])
    led.write_point([_row("a", 2, 0.3)])
    led.write_point([_row("a", 1, 1.0, None)])  # the rerun: skipped, other datasets than before
    assert _view(led.read()) == [("a", 2, "add", {"eval/add": 0.3}), ("a", 1, None, {"eval/skipped_busy": 1.0})]
    note = {"sink_errors": {"wandb": "down"}}
    assert led.update_point("a", 2, lambda rows: [r.model_copy(update=note) for r in rows])
    assert [(r.step, r.sink_errors) for r in led.read("a")] == [(1, {}), (2, {"wandb": "down"})]
    assert [(r.step, r.sink_errors) for r in led.read("a", steps={2})] == [(2, {"wandb": "down"})]
    assert led.update_point("a", 9, lambda rows: rows) is False  # no rows: nothing written
    size = led.path.stat().st_size
    assert led.update_point("a", 2, lambda rows: None) is False and led.path.stat().st_size == size
    assert len(led.path.read_bytes().splitlines()) == 5  # appended, nothing rewritten
    assert led.compact() and len(led.path.read_bytes().splitlines()) == 2
    assert [(r.step, r.sink_errors) for r in led.read("a")] == [(1, {}), (2, {"wandb": "down"})]


def test_a_file_written_before_the_framing_reads_as_it_did_and_a_new_write_replaces_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    old = [_row("a", 1, 0.1), _row("a", 1, 0.2, "sub"), _row("a", 2, 0.3), _row("a", 1, 0.4, "hand")]
    path.write_bytes(b"".join(r.to_line() for r in old))  # unframed; a hand-added row of step 1 at the end
    led = Ledger(path)
    assert led.read() == old and led.read("a", steps={1}) == [old[0], old[1], old[3]]
    seen: list[list[MetricRow]] = []
    assert led.update_point("a", 1, lambda rows: seen.append(rows)) is False  # no frame: the whole file read
    assert seen == [[old[0], old[1], old[3]]]
    led.write_point([_row("a", 1, 0.9)])
    assert _view(led.read()) == [("a", 2, "add", {"eval/add": 0.3}), ("a", 1, "add", {"eval/add": 0.9})]
    path.open("ab").write(_row("a", 1, 0.5, "hand").to_line())  # a row added by hand after the write
    assert [r.dataset for r in led.read("a", steps={1})] == ["add", "hand"]


def test_threads_of_one_process_writing_points_and_one_point_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    led_path, n = tmp_path / "m.jsonl", 20

    def writer(t: int) -> None:
        led = Ledger(led_path)
        for i in range(n):
            led.write_point([_row("own", t * 100 + i, i), _row("own", t * 100 + i, i, "sub")])
            led.write_point([_row("shared", 0, t * 100 + i), _row("shared", 0, t * 100 + i, "sub")])
            led.update_point("shared", 0, lambda rows: [r.model_copy(update={"reason": f"t{t}"}) for r in rows])

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    led = Ledger(led_path)
    own = led.read("own")
    assert sorted((r.step, r.dataset) for r in own) == sorted((t * 100 + i, d) for t in range(4) for i in range(n)
                                                              for d in ("add", "sub"))
    [a, b] = led.read("shared")
    assert (a.dataset, b.dataset) == ("add", "sub") and a.metrics["eval/add"] == b.metrics["eval/sub"]
    assert led.bad_lines == []


_WRITER = """
import sys
from pinned_eval.sinks import Ledger, MetricRow
first, n, width = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
led = Ledger(sys.argv[1], compact_min_bytes=int(sys.argv[5]))
def rows(run, step, value):
    return [MetricRow(run=run, step=step, dataset=f"d{i}", state="measured", metrics={"eval/x": value})
            for i in range(width)]
print("ready", flush=True)
sys.stdin.readline()
for i in range(n):
    led.write_point(rows("own", first + i, i))
    led.write_point(rows("shared", 0, first + i))
    led.update_point("shared", 0, lambda rs: [r.model_copy(update={"reason": str(first)}) for r in rs])
print("done", flush=True)
"""


def _start(path: Path, first: int, n: int, width: int, compact_at: int = 8 << 20) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(first), str(n), str(width), str(compact_at)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)


def _go(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.close()


def _one_complete_write(rows: list[MetricRow], width: int) -> None:
    assert [r.dataset for r in rows] == [f"d{i}" for i in range(width)], _view(rows)
    assert len({r.metrics["eval/x"] for r in rows}) == 1, _view(rows)  # all of one write


def test_two_processes_writing_their_points_and_one_shared_point_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    """Each rewrites the shared point twice a step: compactions run while the other appends."""
    path, n = tmp_path / "m.jsonl", 25
    procs = [_start(path, first, n, 3, compact_at=1024) for first in (0, 1000)]
    try:
        _go(procs)
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    led = Ledger(path)
    own = led.read("own")
    assert sorted((r.step, r.dataset) for r in own) == sorted(
        (first + i, f"d{d}") for first in (0, 1000) for i in range(n) for d in range(3))
    shared = led.read("shared")
    _one_complete_write(shared, 3)
    assert shared[0].reason in ("0", "1000") and led.bad_lines == []


def test_a_reader_never_returns_part_of_a_write_another_process_is_appending(tmp_path: Path) -> None:
    path, width = tmp_path / "m.jsonl", 300  # ~50 KB a write: many pages
    proc = _start(path, 0, 12, width)
    reads = 0
    try:
        _go([proc])
        assert proc.stdout is not None
        done = threading.Event()
        threading.Thread(target=lambda: (proc.stdout.readline(), done.set()), daemon=True).start()  # type: ignore[union-attr]
        led = Ledger(path)
        while not done.is_set() or reads < 5:
            shared = led.read("shared", steps={0})
            if shared:
                _one_complete_write(shared, width)
            assert led.bad_lines == []
            reads += 1
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _one_complete_write(Ledger(path).read("shared"), width)
    assert len(Ledger(path).read("own")) == 12 * width


def test_a_write_in_flight_or_cut_short_is_never_read_and_a_cut_one_is_noted_once_settled(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "m.jsonl")
    led.write_point([_row("a", 1, 0.1), _row("a", 1, 0.2, "sub")])
    before = led.read()
    with open(led.path, "ab") as f:  # a rerun's first line of 3, and the start of its second
        f.write(_row("a", 1, 0.9).to_line()[:-2] + b',"write":"0123456789ab/3"}\n' + b'{"run":"a","step":1,"da')
    with locked(led.path):  # the writer still holds the lock: in flight
        assert led.read() == before and led.bad_lines == []
    assert led.read() == before  # settled: the lock is free, so the write was cut short
    assert [b.split(": ")[0] for b in led.bad_lines] == [f"{led.path}:3", f"{led.path}:4"]
    led.write_point([_row("a", 2, 0.5)])  # after a cut write: its own line, read
    assert _view(led.read())[-1] == ("a", 2, "add", {"eval/add": 0.5}) and led.read("a", steps={1}) == before
    led.write_point([_row("a", 2, 0.6)])
    assert led.compact()  # step 2's first write dropped; the cut lines kept byte for byte, as every bad line
    assert led.path.read_bytes().splitlines()[2].startswith(b'{"run":"a","step":1,"dataset":"add"')
    assert led.path.read_bytes().splitlines()[3] == b'{"run":"a","step":1,"da'


def test_writes_compact_the_file_when_half_of_it_is_dead_and_never_otherwise(tmp_path: Path) -> None:
    unit = 4096
    led = Ledger(tmp_path / "m.jsonl", compact_min_bytes=unit)
    for step in range(60):  # distinct points: nothing dead, never rewritten
        led.write_point([_row("a", step, step)])
    inode = led.path.stat().st_ino
    assert led.path.stat().st_size > 2 * unit and led.path.stat().st_ino == inode
    live = led.path.stat().st_size
    sizes = []
    for i in range(400):  # one point rewritten again and again: its old writes are dead
        led.write_point([_row("a", 0, 1000 + i), _row("a", 0, i, "sub")])
        sizes.append(led.path.stat().st_size)
    assert led.path.stat().st_ino != inode  # compacted (a new file renamed over it)
    assert max(sizes) < 4 * live + 2 * unit  # bounded by the live rows, not by the writes
    assert _view(led.read("a", steps={0})) == [("a", 0, "add", {"eval/add": 1399.0}),
                                               ("a", 0, "sub", {"eval/sub": 399.0})]
    assert len(led.read()) == 61


_COMPACTOR = """
import sys
from pinned_eval.sinks import Ledger, ledger_file
where = sys.argv[2]
real_write, real_replace = ledger_file.write_lines, ledger_file.replace_durably
def pause():
    print("paused", flush=True)
    sys.stdin.readline()
def half_then_pause(f, lines):
    real_write(f, lines[: len(lines) // 2]); f.flush(); pause(); real_write(f, lines[len(lines) // 2 :])
def synced_then_pause(tmp, dest):
    ledger_file.fsync_path(tmp); pause(); real_replace(tmp, dest)
if where == "writing":
    ledger_file.write_lines = half_then_pause
else:
    ledger_file.replace_durably = synced_then_pause
print("compacted", Ledger(sys.argv[1]).compact(), flush=True)
"""


def _compactor(led: Ledger, where: str) -> subprocess.Popen[str]:
    for i in range(50):
        led.write_point([_row("a", i % 5, i), _row("a", i % 5, i, "sub")])
    with open(led.path, "ab") as f:
        f.write(b"not a row\n")
    return subprocess.Popen([sys.executable, "-c", _COMPACTOR, str(led.path), where], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=ENV)


@pytest.mark.parametrize("where", ["writing", "before-rename"])
def test_a_write_during_another_process_compaction_waits_for_it_and_is_kept(tmp_path: Path, where: str) -> None:
    led = Ledger(tmp_path / "m.jsonl")
    proc, new = _compactor(led, where), _row("b", 1, 0.5)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "paused"
        writer = threading.Thread(target=led.write_point, args=([new],))
        writer.start()  # blocks on the lock (without it: appended to the file being replaced, lost)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.close()
        assert proc.stdout.readline().strip() == "compacted True" and proc.wait(timeout=30) == 0
        writer.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert led.read("b") == [new] and len(led.read("a")) == 10


@pytest.mark.parametrize("where", ["writing", "before-rename"])
def test_a_compaction_killed_mid_way_leaves_the_old_file_whole(tmp_path: Path, where: str) -> None:
    led = Ledger(tmp_path / "m.jsonl")
    proc = _compactor(led, where)
    old_bytes = led.path.read_bytes()
    old_rows = led.read()
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "paused"
        assert [p.name.endswith(".tmp") for p in tmp_path.iterdir()].count(True) == 1  # the new file, mid-way
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert led.path.read_bytes() == old_bytes and led.read() == old_rows
    new = _row("a", 0, 99)
    led.write_point([new])  # the lock died with it
    assert led.compact() and led.read("a", steps={0}) == [new]
    assert led.path.read_bytes().endswith(b"not a row\n" + new.to_line())


def test_a_writes_bytes_do_not_depend_on_the_files_length_and_it_reads_nothing_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small, large = Ledger(tmp_path / "small.jsonl"), Ledger(tmp_path / "large.jsonl")
    small.write_point([_row("a", 0, 0.0)])
    ledger_file.append(large.path, [r.to_line() for step in range(2000)
                                    for r in (_row("a", step, 0.0), _row("a", step, 0.0, "sub"))])
    io: dict[str, list[int]] = {}
    real_write, real_pread = os.write, os.pread

    def write(fd: int, data: bytes) -> int:
        io.setdefault(os.readlink(f"/proc/self/fd/{fd}") + " write", []).append(len(data))
        return real_write(fd, data)

    def pread(fd: int, n: int, at: int) -> bytes:
        io.setdefault(os.readlink(f"/proc/self/fd/{fd}") + " read", []).append(n)
        return real_pread(fd, n, at)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(ledger_file.Scan, "run", lambda *a: pytest.fail("a write scanned the file"))
    point = [_row("b", 7, 0.5), _row("b", 7, 0.25, "sub")]
    small.write_point(point)
    large.write_point(point)
    assert large.path.stat().st_size > 300 * small.path.stat().st_size
    want = sum(len(r.to_line()) + len(',"write":"0123456789ab/2"') for r in point)
    assert io == {f"{small.path} write": [want], f"{small.path} read": [1],  # one write; the last byte
                  f"{large.path} write": [want], f"{large.path} read": [1]}


def test_a_note_on_a_recent_point_scans_the_files_tail_and_names_bad_lines_by_their_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    led = Ledger(tmp_path / "m.jsonl")
    ledger_file.append(led.path, [_row("a", step, 0.0).to_line() for step in range(3000)])
    led.write_point([_row("b", 7, 0.5), _row("b", 7, 0.25, "sub")])
    with open(led.path, "ab") as f:
        f.write(b'{"run":"b","step":7,"dataset":"cut", "sta\n')  # line 3003, after the point's write
    led.write_point([_row("c", 1, 0.0)])
    scanned: list[int] = []
    real = ledger_file.Scan._line
    monkeypatch.setattr(ledger_file.Scan, "_line", lambda self, n, raw: (scanned.append(n), real(self, n, raw)))
    note = {"sink_errors": {"mlflow": "down"}}
    assert led.update_point("b", 7, lambda rows: [r.model_copy(update=note) for r in rows])
    assert scanned == [1, 2, 3, 4]  # from the point's last write on: 4 lines of 3,004
    assert [b.split(": ")[0] for b in led.bad_lines] == [f"{led.path}:3003"]
    assert [(r.dataset, r.sink_errors) for r in led.read("b")] == [("add", note["sink_errors"]),
                                                                   ("sub", note["sink_errors"])]
    scanned.clear()
    assert led.update_point("a", 5, lambda rows: [r.model_copy(update=note) for r in rows])  # in the big write
    assert scanned[0] == 1 and len(scanned) == 3006  # from its write at the start: every line
    assert [r.sink_errors for r in led.read("a", steps={5})] == [note["sink_errors"]]


def test_a_symlink_planted_at_the_ledgers_name_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"theirs\n")
    (tmp_path / "m.jsonl").symlink_to(target)
    with pytest.raises(OSError) as caught:
        Ledger(tmp_path / "m.jsonl").write_point([_row("a", 1, 0.1)])
    assert caught.value.errno == errno.ELOOP and target.read_bytes() == b"theirs\n"
