"""Temp files named after their writer: a crash between write and rename leaves a file anyone can
prove orphaned (no Prefect import).

A writer writes each file to `.tmp-p<pid>s<start>-<name>` (`temp_name`), then renames it to
`<name>`: `<pid>` is the writing process and `<start>` its start time in clock ticks since boot
(`/proc/<pid>/stat`, field 22), fixed for the life of a process and independent of the wall
clock. A temp file is never read by a consumer. `sweep_temps` removes one whose writer is provably
gone: no process `<pid>`, or a process `<pid>` that started at another tick (the PID was reused).
A live writer always matches its own name, so its temp file is never removed; a dead writer whose
PID was reused by a process started in the same tick is only kept until that process ends too.
Without `/proc` (`<start>` 0) a temp file is removed once no process `<pid>` exists. Writer and
sweeper share one PID namespace (one host, as a worker and its flow runs). Used by the Prometheus
metrics directory (`pinned_eval.prometheus_totals`) and the tracker outbox
(`pinned_eval.sinks.outbox`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

TMP_PREFIX = ".tmp-"
_TMP_NAME = re.compile(r"^\.tmp-p([1-9][0-9]*)s([0-9]+)-")  # .tmp-p<pid>s<start>-<name>
_PROC = os.path.exists("/proc/self/stat")
_me: tuple[int, int] = (0, 0)  # (pid, start ticks) of this process, read once per process


def _start_ticks(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot; None when no such process exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # pid (comm) state ppid ...: comm may hold spaces and parentheses; starttime is field 22
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def temp_name(name: str) -> str:
    """The temp name under which this process writes `name` before renaming it (module docstring)."""
    global _me
    pid = os.getpid()
    if _me[0] != pid:  # first call, or a forked child
        try:
            start = _start_ticks(pid) if _PROC else None
        except (OSError, ValueError, IndexError):
            start = None
        _me = (pid, start or 0)
    return f"{TMP_PREFIX}p{pid}s{_me[1]}-{name}"


def _writer_gone(pid: int, start: int) -> bool:
    if _PROC and start:
        try:
            return _start_ticks(pid) != start
        except (OSError, ValueError, IndexError):
            return False  # unreadable: not provably gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # another user's process: alive
    return False


def sweep_temps(directory: Path, on_orphan: Callable[[str], None] | None = None) -> None:
    """Remove the temp files in `directory` whose writer is provably gone (module docstring);
    `on_orphan(name)` for each one removed."""
    for name in os.listdir(directory):
        m = _TMP_NAME.match(name)
        if m is not None and _writer_gone(int(m.group(1)), int(m.group(2))):
            try:
                os.unlink(directory / name)
            except FileNotFoundError:
                continue  # another sweep's
            if on_orphan is not None:
                on_orphan(name)
