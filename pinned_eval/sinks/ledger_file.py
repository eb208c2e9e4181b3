"""The ledger's file format and its machinery: framed appends, the scan that reads them, compaction.

A write (`append`) is one `write(2)` of its rows with `O_APPEND`, then an fsync, under the exclusive
flock of `<file>.lock`. Each line of it ends with the write's frame, `"write":"<id>/<n>"` as the
last key: a random 12-hex id shared by the write's `n` lines (the rows of one write are contiguous:
writers are serialised by the lock). The frame is the file's, never a `MetricRow` field: the scan
strips it before the row is parsed, so the rows read back are exactly those written.

The scan (`Scan`) reads the lines in file order and decides what is live:
- a complete write (its `n` framed lines, contiguous) replaces every earlier row of each point in
  it; an unframed row (a file written before writes were framed, or a line added by hand) adds
  itself to its point's rows, as every row did then;
- a framed line outside a complete write (a writer killed mid-write) and a line that is not a
  metric row are bad lines: skipped, noted (`bad`, `file:line`) and kept byte for byte by
  compaction; a scan that could not take the shared lock (a writer active) passes over the
  incomplete write at the file's end and its unterminated last line silently: they are in flight.

`last_write_of` finds, reading backwards, where a point's last complete write starts: a scan from
there reads the same rows of that point as a scan of the whole file (what came before is replaced).

A reader opens the file and reads its size under a non-blocking shared flock, then releases it
and scans that many bytes: a writer never waits for a reader and a reader never for a writer.

Appends open the file with `O_NOFOLLOW`: a symlink planted at its name is refused (ELOOP), its
target untouched.

`compact` rewrites the file without its dead lines (rows a later write replaced, blank lines)
through a temp file + fsync + rename (`replace_durably`), under the exclusive lock: a crash
leaves the old file whole. Live rows lose their frame (the point's only rows: unframed rows of one
point read as one set), bad lines are kept byte for byte where they were.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from pinned_eval.durable import fsync_path, replace_durably

log = logging.getLogger("pinned_eval.sinks.ledger")
# the start of a line `MetricRow.to_line` wrote: its run (a JSON string) and step, in that order
HEAD = re.compile(rb'\{"run":("(?:[^"\\]|\\.)*"),"step":(-?\d+)[,}]')
_FRAME_KEY = b',"write":"'
FRAME = re.compile(rb',"write":"([0-9a-f]{12})/([1-9][0-9]{0,8})"\}\r?\n?')

Point = tuple[str, int]


class Row(Protocol):
    run: str
    step: int


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """The exclusive lock every writer holds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(path), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def snapshot(path: Path) -> Iterator[tuple[BinaryIO, int, bool] | None]:
    """(the open file, its size, settled) or None when there is no file. `settled`: the size was
    read under the shared lock (no write in flight then); never waits for it."""
    settled = False
    lock_fd = -1
    try:
        lock_fd = os.open(lock_path(path), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        settled = True
    except OSError:  # no lock file (no writer yet), not ours to read, or a writer holds it
        pass
    try:
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            f = None
        size = os.fstat(f.fileno()).st_size if f is not None else 0
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)  # releases the shared lock
    if f is None:
        yield None
        return
    with f:
        yield f, size, settled


def frame_of(raw: bytes) -> re.Match[bytes] | None:
    at = raw.rfind(_FRAME_KEY, max(0, len(raw) - 40))
    return FRAME.fullmatch(raw, at) if at >= 0 else None


def append(path: Path, lines: list[bytes]) -> tuple[int, int]:
    """Append `lines` (each `...}\\n`) as one framed write, fsync'd; under `locked`. Returns the
    file's size before and after. A file ending in an unterminated line gets its newline first."""
    frame = f',"write":"{secrets.token_hex(6)}/{len(lines)}"}}\n'.encode()
    data = b"".join(line[:-2] + frame for line in lines)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        before = os.fstat(fd).st_size
        if before and os.pread(fd, 1, before - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if before == 0:
        fsync_path(path.parent)  # a new file: its name durable too
    return before, before + len(data)


@dataclass
class _Line:
    lineno: int
    raw: bytes  # b"" unless the scan keeps them (`Scan.keep_raw`)
    size: int
    row: Row | None = None  # the parsed row; None: a bad line
    dead: bool = False


@dataclass
class Scan:
    """One pass over the file (see the module docstring); `lines`: the rows read and the bad
    lines, in file order (`dead`: replaced by a later write)."""

    path: Path
    parse: Callable[[bytes], Row]  # raises ValueError when the bytes are not a row
    wanted: Callable[[str, int], bool] | None = None
    keep_raw: bool = False  # compaction's scan: the lines' bytes, to write them again
    lines: list[_Line] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)
    dead_bytes: int = 0
    _live: dict[Point, list[_Line]] = field(default_factory=dict)
    _open: list[_Line] = field(default_factory=list)  # the framed write being read (lines kept)
    _open_id: tuple[bytes, int] | None = None
    _open_seen: int = 0  # its lines so far, the unwanted ones included
    _open_last: int = 0  # the number of its last line so far
    lines_before: Callable[[], int] | None = None  # a scan from an offset: the lines before it

    def run(self, f: BinaryIO, size: int, settled: bool) -> Scan:
        pos = lineno = 0
        for raw in f:
            if pos + len(raw) > size:
                raw = raw[: size - pos]
            if not raw:
                break
            pos += len(raw)
            if not settled and not raw.endswith(b"\n"):
                break  # a line still being written
            lineno += 1
            self._line(lineno, raw)
        if self._open_id is not None and (settled or self._open_last != lineno):
            self._torn()  # else: the write in flight at the end, passed over
        return self

    def rows(self) -> list[Row]:
        return [ln.row for ln in self.lines if not ln.dead and ln.row is not None]

    def _line(self, lineno: int, raw: bytes) -> None:
        if raw[:1].isspace() and not raw.strip():
            self.dead_bytes += len(raw)
            return
        m = frame_of(raw)
        frame = (m[1], int(m[2])) if m else None
        if self._open_id is not None and frame != self._open_id:
            self._torn()
        if frame is not None:
            self._open_id, self._open_seen, self._open_last = frame, self._open_seen + 1, lineno
        if self._wanted(raw):
            line = _Line(lineno, raw if self.keep_raw else b"", len(raw))
            self._parse(line, raw[: m.start()] + b"}" if m else raw)
            if frame is not None:
                self._open.append(line)
            else:
                self.lines.append(line)
                if line.row is not None:
                    self._live.setdefault((line.row.run, line.row.step), []).append(line)
        if frame is not None and self._open_seen == frame[1]:
            self._commit()

    def _wanted(self, raw: bytes) -> bool:
        """False for a line whose head names a point not wanted: it is passed over unparsed."""
        if self.wanted is None or (head := HEAD.match(raw)) is None:
            return True
        quoted = head[1]
        try:  # a run without escapes is its bytes (json.loads only for the others: 3x the scan)
            run = json.loads(quoted) if b"\\" in quoted else quoted[1:-1].decode()
            step = int(head[2])
        except ValueError:
            return True
        return self.wanted(run, step)

    def _parse(self, line: _Line, body: bytes) -> None:
        try:
            line.row = self.parse(body)
        except ValueError as exc:  # not JSON, not UTF-8, not a metric row
            self._note(line.lineno, f"not a metric row ({str(exc).splitlines()[0][:200]})")

    def _commit(self) -> None:
        group = self._close()
        for point in {(r.run, r.step) for ln in group if (r := ln.row) is not None}:
            for old in self._live.pop(point, []):
                old.dead = True
                self.dead_bytes += old.size
        for line in group:
            self.lines.append(line)
            if (r := line.row) is not None:
                self._live.setdefault((r.run, r.step), []).append(line)

    def _torn(self) -> None:
        seen, group = self._open_seen, self._close()
        for line in group:
            if line.row is not None:
                line.row = None
                self._note(line.lineno, f"part of an incomplete write ({seen} of its lines here)")
            self.lines.append(line)

    def _close(self) -> list[_Line]:
        group, self._open, self._open_id, self._open_seen = self._open, [], None, 0
        return group

    def _note(self, lineno: int, problem: str) -> None:
        if self.lines_before is not None:
            lineno += self.lines_before()
        self.bad.append(f"{self.path}:{lineno}: {problem}")
        log.warning("%s:%d: %s; skipped and kept as is", self.path, lineno, problem)


def last_write_of(f: BinaryIO, size: int, is_point: Callable[[bytes], bool], chunk: int = 1 << 20) -> int | None:
    """The offset of the last complete framed write holding a line of the point (`is_point(line)`),
    read backwards from `size`: everything of the point before it is replaced, so a scan from there
    reads the point's rows. None when there is none (the whole file is scanned then)."""
    cur_id: bytes | None = None
    cur_n = cur_count = cur_start = 0
    cur_has = False
    pos, carry = size, b""
    while pos > 0:
        step = min(chunk, pos)
        pos -= step
        f.seek(pos)
        data = f.read(step) + carry
        parts = data.split(b"\n")
        carry = parts[0] if pos > 0 else b""
        starts, at = [], pos
        for part in parts:
            starts.append(at)
            at += len(part) + 1
        for i in range(len(parts) - 1, 0 if pos > 0 else -1, -1):
            line = parts[i]
            if not line:
                continue
            m = frame_of(line)
            lid = m[1] if m else None
            if lid != cur_id:
                cur_id, cur_n, cur_count, cur_has = lid, int(m[2]) if m else 0, 0, False
            if m is None:
                continue
            cur_count, cur_start, cur_has = cur_count + 1, starts[i], cur_has or is_point(line)
            if cur_count == cur_n:  # a whole write: its first line reached
                if cur_has:
                    return cur_start
                cur_id = None
    return None


def count_lines(path: Path, end: int) -> int:
    """The lines in the first `end` bytes of `path` (a handle of its own: a scan may be reading)."""
    n, left = 0, end
    with open(path, "rb") as f:
        while left > 0 and (block := f.read(min(left, 1 << 20))):
            n, left = n + block.count(b"\n"), left - len(block)
    return n


def compact(scan: Scan) -> None:
    """Rewrite the scanned file (a full, settled scan under `locked`) with its live lines only."""
    path = scan.path
    out: list[bytes] = []
    for line in scan.lines:
        if line.dead:
            continue
        raw = line.raw
        if line.row is not None and (m := frame_of(raw)) is not None:
            raw = raw[: m.start()] + b"}\n"
        out.append(raw if raw.endswith(b"\n") else raw + b"\n")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write_lines(f, out)
        replace_durably(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_lines(f: BinaryIO, lines: list[bytes]) -> None:
    f.writelines(lines)
