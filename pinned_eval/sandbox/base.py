"""What every sandbox backend shares: limits, the result, the protocol, and one bounded collector.

Contract of a run (every backend):
- the command starts in its own session (`start_new_session`, as `pinned_eval.processes` starts
  everything) and, when the worker is root, as the unprivileged sandbox user;
- stdout and stderr are read together up to `limits.output_bytes`; one byte more kills the run
  (`output_limit`), so a flood never reaches the worker's memory;
- at `limits.wall_s` the run is SIGKILLed (`timeout`);
- when the program exits or is killed, its process group is SIGKILLed; under bwrap a kill also
  SIGKILLs its whole pid namespace and waits until it is empty (`SandboxError` if a process
  survives), so nothing stays running unnoticed.
"""

from __future__ import annotations

import contextlib
import os
import resource  # noqa: F401  (os.wait4 imports it lazily; import it while the files are readable)
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.polling import PollTimeout, poll_until


class SandboxError(RuntimeError):
    """A sandbox cannot be created or used as asked (the message names the field or the fix)."""


class SandboxUnavailable(SandboxError):
    """The backend's system requirements are missing (bwrap, prlimit, the sandbox user)."""


class SandboxLimits(BaseModel):
    """Per-run limits; every field has a default, so `SandboxLimits()` is a safe run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wall_s: float = Field(default=30.0, gt=0, le=3600, description="Kill deadline from start, seconds.")
    cpu_s: int = Field(default=30, ge=1, le=3600, description="RLIMIT_CPU: SIGXCPU at this many CPU seconds.")
    memory_mb: int = Field(default=1024, ge=64, description="RLIMIT_AS (address space) per process, MiB.")
    processes: int = Field(default=64, ge=8, le=4096, description="RLIMIT_NPROC of the sandbox uid (threads count).")
    output_bytes: int = Field(default=1 << 20, ge=256, description="stdout + stderr kept; one byte more kills the run.")
    file_mb: int = Field(default=16, ge=1, description="RLIMIT_FSIZE: the largest file a process may write, MiB.")
    disk_mb: int = Field(default=64, ge=1, description="Size of the work directory (a tmpfs under bwrap), MiB.")
    open_files: int = Field(default=256, ge=16, le=65536, description="RLIMIT_NOFILE.")


class Outcome(StrEnum):
    OK = "ok"  # exit code 0
    ERROR = "error"  # non-zero exit
    TIMEOUT = "timeout"  # killed at the wall deadline
    CPU = "cpu"  # RLIMIT_CPU (SIGXCPU, or SIGKILL after using the CPU seconds)
    MEMORY = "memory"  # the program died of a Python MemoryError (RLIMIT_AS)
    OUTPUT_LIMIT = "output_limit"  # killed after output_bytes
    KILLED = "killed"  # killed by another signal
    START_FAILED = "start_failed"  # the sandbox itself did not start (bwrap/prlimit said why on stderr)


class RunResult(BaseModel):
    """One run. `unsafe` is True for the unsafe backend, on every result, so a caller can report it."""

    model_config = ConfigDict(frozen=True)

    backend: str
    unsafe: bool
    outcome: Outcome
    exit_code: int | None = Field(description="Negative: killed by that signal (as subprocess reports it).")
    stdout: str
    stderr: str
    truncated: bool = False
    wall_s: float
    cpu_s: float = Field(description="CPU seconds of the program and the children it waited for.")
    pid_namespace: int | None = Field(default=None, description="The run's pid namespace inode (bwrap).")
    warning: str | None = Field(default=None, description="Set on every unsafe result, for the point to report.")

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


@runtime_checkable
class Sandbox(Protocol):
    """Runs untrusted code: `code` (Python source, run as `main.py` in the work dir) or `argv`."""

    name: str
    unsafe: bool

    def run(
        self,
        code: str | None = None,
        *,
        argv: list[str] | None = None,
        files: Mapping[str, bytes | str] | None = None,
        stdin: bytes = b"",
        limits: SandboxLimits | None = None,
    ) -> RunResult: ...


CODE_FILE = "main.py"


def check_files(files: Mapping[str, bytes | str] | None, code: str | None) -> dict[str, bytes]:
    """Relative, normalized file names only (no `..`, no absolute path, not the code file)."""
    out: dict[str, bytes] = {}
    for name, data in (files or {}).items():
        path = PurePosixPath(name)
        if not name or path.is_absolute() or ".." in path.parts or str(path) != name or name.startswith("./"):
            raise SandboxError(f"sandbox files: {name!r} must be a relative path inside the work directory")
        if code is not None and name == CODE_FILE:
            raise SandboxError(f"sandbox files: {CODE_FILE!r} is taken by the code to run")
        out[name] = data.encode() if isinstance(data, str) else bytes(data)
    if code is not None:
        out[CODE_FILE] = code.encode()
    return out


def command_of(code: str | None, argv: list[str] | None, python: str) -> list[str]:
    if (code is None) == (argv is None):
        raise SandboxError("sandbox run: give exactly one of code or argv")
    if argv is not None:
        if not argv or not all(isinstance(a, str) and a for a in argv):
            raise SandboxError("sandbox run: argv must be a non-empty list of non-empty strings")
        return list(argv)
    return [python, "-s", CODE_FILE]


def prlimit_argv(prlimit: str, limits: SandboxLimits, nproc: int) -> list[str]:
    """`prlimit` sets the limits on itself, then execs the rest of the command (kept on exec)."""
    mib = 1 << 20
    return [prlimit, f"--as={limits.memory_mb * mib}", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
            f"--nproc={nproc}", f"--fsize={limits.file_mb * mib}", f"--nofile={limits.open_files}", "--core=0", "--"]


def signal_of(exit_code: int | None, *, shell_style: bool) -> int | None:
    """The signal that ended the program: a negative code, or 128+N when relayed (bwrap, a shell)."""
    if exit_code is None:
        return None
    if exit_code < 0:
        return -exit_code
    if shell_style and 128 < exit_code < 128 + 65:
        return exit_code - 128
    return None


def classify(exit_code: int, stderr: str, cpu_s: float, limits: SandboxLimits, *, shell_style: bool) -> Outcome:
    if exit_code == 0:
        return Outcome.OK
    sig = signal_of(exit_code, shell_style=shell_style)
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits.cpu_s):
        return Outcome.CPU
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    if last.startswith("MemoryError"):
        return Outcome.MEMORY
    return Outcome.KILLED if sig is not None else Outcome.ERROR


def namespace_members(pid_ns: int) -> list[int]:
    """Host PIDs of the live (not zombie) processes in pid namespace `pid_ns`."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/pid").st_ino == pid_ns:
                    with open(f"/proc/{entry}/stat") as f:
                        if f.read().rpartition(")")[2].split()[0] != "Z":
                            members.append(int(entry))
    return members


def tasks_of_uid(uid: int) -> int:
    """Tasks (threads count, as RLIMIT_NPROC counts them) of the live processes of `uid`."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
    return count


class Collected(BaseModel):
    exit_code: int
    stdout: bytes
    stderr: bytes
    status: bytes
    killed_for: Outcome | None
    truncated: bool
    wall_s: float
    cpu_s: float


def collect(
    popen: subprocess.Popen[bytes], *, limits: SandboxLimits, started: float, status_fd: int | None = None
) -> Collected:
    """Read stdout/stderr (and bwrap's status pipe) until the process exits and the pipes close,
    within the wall deadline and the output cap; kill the process group on either."""
    assert popen.stdout is not None and popen.stderr is not None
    out_fd, err_fd = popen.stdout.fileno(), popen.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    status = bytearray()
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    if status_fd is not None:
        sel.register(status_fd, selectors.EVENT_READ)
    pidfd = os.pidfd_open(popen.pid)
    sel.register(pidfd, selectors.EVENT_READ)
    total, killed_for = 0, None
    deadline = started + limits.wall_s
    try:
        while killed_for is None and sel.get_map():  # the pidfd until exit, each pipe until EOF
            left = deadline - time.monotonic()
            if left <= 0:
                killed_for = Outcome.TIMEOUT
                break
            for key, _ in sel.select(left):
                fd = int(key.fd)
                if fd == pidfd:
                    sel.unregister(pidfd)
                    _kill_group(popen.pid)  # anything the program left behind in its group
                    continue
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(fd)
                    continue
                if fd == status_fd:
                    status += data
                    continue
                keep = max(0, limits.output_bytes - total)
                bufs[fd] += data[:keep]
                total += len(data)
                if total > limits.output_bytes:
                    killed_for = Outcome.OUTPUT_LIMIT
                    break
    finally:
        sel.close()
        os.close(pidfd)
    if killed_for is not None:
        _kill_group(popen.pid)
    _, wstatus, usage = os.wait4(popen.pid, 0)
    popen.returncode = os.waitstatus_to_exitcode(wstatus)
    for stream in (popen.stdout, popen.stderr):
        stream.close()
    return Collected(
        exit_code=popen.returncode, stdout=bytes(bufs[out_fd]), stderr=bytes(bufs[err_fd]),
        status=bytes(status), killed_for=killed_for,
        truncated=killed_for is Outcome.OUTPUT_LIMIT, wall_s=time.monotonic() - started,
        cpu_s=usage.ru_utime + usage.ru_stime,
    )


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def reap_namespace(pid_ns: int, *, timeout_s: float = 5.0) -> None:
    """SIGKILL every process left in `pid_ns` and wait until none is left; `SandboxError` if one survives."""

    def empty() -> bool:
        members = namespace_members(pid_ns)
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return not members

    try:
        poll_until(empty, timeout_s=timeout_s, interval_s=0.02, what=f"sandbox pid namespace {pid_ns} to empty")
    except PollTimeout as exc:
        raise SandboxError(f"sandbox processes survived SIGKILL: {exc}") from None


def decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
