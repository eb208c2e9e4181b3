"""The one process manager: spawn (own process group, log file), wait until healthy, stop by group.

Used by the fleet launcher, the CPU engine launcher (`fleet.cpu_engine`), the external SGLang
backend and the app's Prefect server and worker.

Invariants:
- Every process starts with `start_new_session=True`, so its PID is its process-group id and
  killing the group takes its children with it.
- A record keeps the PID and the process's start time; `stop_process` only signals a PID whose
  start time still matches (a reused PID is someone else's), or a group whose leader is gone
  (Linux never reuses a PID while a group of that id exists, so such a group is still ours).
- Ports are picked by binding port 0 on 127.0.0.1; nothing binds another interface.
- In a process that called `children_die_with_me()` (the backend host), every process started
  here also gets a parent-death signal (SIGKILL, `PR_SET_PDEATHSIG`, set in the child before
  exec): a SIGKILLed host orphans nothing. Linux sends it when the *thread* that started the
  child ends, so launch from a thread that lives as long as the process (the host's executor
  threads do). `pinned-eval worker` calls it too (its worker, warm-start server and backend host
  die with it); the daemons `server up` and `LocalStack.worker_up` start are started without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Literal

import httpx
import psutil
from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.polling import PollTimeout, poll_until


class LaunchError(RuntimeError):
    """A managed process did not start, exited early, never became healthy, or survived SIGKILL."""


class ProcessSpec(BaseModel):
    """How to start one fleet process."""

    model_config = ConfigDict(frozen=True)

    role: Literal["engine", "router", "prefect-server", "worker", "warm-start", "backend-host", "deliverer"]
    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(
        default_factory=dict, repr=False, description="Added on top of the launcher's environment (never in repr)."
    )
    port: int = Field(default=0, ge=0, lt=65536, description="0: the process serves nothing (a worker).")
    host: str = "127.0.0.1"
    health_path: str = "/health"
    cwd: str | None = Field(default=None, description="Working directory (default: the launcher's).")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class ProcessRecord(BaseModel):
    """A started process: its spec, PID, start time and log file."""

    spec: ProcessSpec
    pid: int
    create_time: float
    log_path: str

    @property
    def url(self) -> str:
        return self.spec.url


_PR_SET_PDEATHSIG = 1
_die_with_me = False
_prctl: ctypes._NamedFuncPointer | None = None
_parent_pid = 0


def children_die_with_me() -> None:
    """From now on, every process `start_process` starts is SIGKILLed when this process dies."""
    global _die_with_me, _prctl, _parent_pid
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    _parent_pid, _die_with_me = os.getpid(), True


def _set_parent_death_signal() -> None:
    """In the forked child, before exec: a system call, then a check that the parent did not die
    before it (the signal would never come)."""
    assert _prctl is not None
    if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != _parent_pid:
        os._exit(127)


def pipe_child_options(*, memory_bytes: int | None = None) -> dict[str, object]:
    """Keyword arguments of `subprocess.Popen` / `asyncio.create_subprocess_exec` for a child this
    process talks to over pipes (the agentic runner): its own session (PID = process-group id, so
    `stop_groups([pid])` ends it and its children), a parent-death SIGKILL always, and with
    `memory_bytes` an address-space limit (`RLIMIT_AS`), so a memory blow-up fails the child only."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    parent = os.getpid()

    def before_exec() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
            os._exit(127)
        if memory_bytes is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    return {"start_new_session": True, "preexec_fn": before_exec}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_process(spec: ProcessSpec, log_path: Path | None) -> tuple[ProcessRecord, subprocess.Popen[bytes]]:
    """Start `spec` detached in a new session, stdout+stderr appended to `log_path` (None: this
    process's own stdout and stderr, for a foreground child)."""
    if log_path is None:
        proc = _popen(spec, None)
    else:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%Y-%m-%dT%H:%M:%S')}: {' '.join(spec.command)}\n".encode())
            log.flush()
            proc = _popen(spec, log)
    try:
        created = psutil.Process(proc.pid).create_time()
    except psutil.NoSuchProcess:
        created = 0.0
    return ProcessRecord(spec=spec, pid=proc.pid, create_time=created, log_path=str(log_path or "")), proc


def _popen(spec: ProcessSpec, log: IO[bytes] | None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        spec.command,
        env={**os.environ, **spec.env},
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT if log is not None else None,
        start_new_session=True,
        cwd=spec.cwd,
        preexec_fn=_set_parent_death_signal if _die_with_me else None,  # one syscall: thread-safe
    )


def is_running(record: ProcessRecord) -> bool:
    """True while the recorded process (same PID and start time) is alive and not a zombie."""
    try:
        proc = psutil.Process(record.pid)
        return abs(proc.create_time() - record.create_time) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _group_alive(pgid: int) -> bool:
    """True while some non-zombie process is in group `pgid` (zombies of another parent don't count)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pgid, os.WNOHANG)  # reap the leader if it is our child
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return False


def _ours(record: ProcessRecord) -> bool:
    """False when the recorded PID now belongs to another process (so our group is long gone)."""
    try:
        return abs(psutil.Process(record.pid).create_time() - record.create_time) < 0.05
    except psutil.NoSuchProcess:
        return True  # leader gone; a surviving group with this id can only be ours


def stop_processes(records: list[ProcessRecord], *, grace_s: float = 10.0) -> None:
    """SIGTERM every record's process group at once, SIGKILL survivors after `grace_s`."""
    stop_groups([r.pid for r in records if _ours(r)], grace_s=grace_s)


def stop_groups(pgids: list[int], *, grace_s: float = 10.0) -> None:
    """SIGTERM the process groups `pgids` (each led by a process this program started), SIGKILL
    what is left after `grace_s`; `LaunchError` if a group survives SIGKILL."""
    groups = set(pgids)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pgid in list(groups):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                groups.discard(pgid)

        with contextlib.suppress(PollTimeout):
            poll_until(lambda: not _prune(groups), timeout_s=wait_s, interval_s=0.05, what="process groups to exit")
        if not groups:
            return
    raise LaunchError(f"process groups {sorted(groups)} survived SIGKILL")


def _prune(groups: set[int]) -> set[int]:
    """Drop the groups that have no live process left; return what remains (the same set)."""
    groups.intersection_update({g for g in groups if _group_alive(g)})
    return groups


def pid_alive(pid: int) -> bool:
    """True while `pid` runs. An exited child of this process is reaped first (a zombie is not alive)."""
    with contextlib.suppress(ChildProcessError):  # not our child: its parent reaps it
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        if reaped == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_process(record: ProcessRecord, *, grace_s: float = 10.0) -> None:
    stop_processes([record], grace_s=grace_s)


def log_tail(path: str | Path, n_bytes: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n_bytes))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"


def wait_healthy(
    record: ProcessRecord,
    healthy: Callable[[], bool],
    *,
    timeout_s: float,
    popen: subprocess.Popen[bytes] | None = None,
    what: Callable[[], str] | None = None,
) -> None:
    """Poll `healthy()` until True; `LaunchError` (with the log tail) when the process exits first
    or `timeout_s` passes. `what()` describes the last probe for the timeout message."""

    def check() -> bool:
        exited = popen.poll() is not None if popen is not None else not is_running(record)
        if exited:
            raise LaunchError(
                f"{record.spec.role} on port {record.spec.port} exited before it was healthy; "
                f"log {record.log_path}:\n{log_tail(record.log_path)}"
            )
        return healthy()

    try:
        poll_until(check, timeout_s=timeout_s, what=what or (lambda: f"{record.url} healthy"))
    except PollTimeout as exc:
        raise LaunchError(f"not healthy: {exc}; log {record.log_path}:\n{log_tail(record.log_path)}") from None


def wait_http_ok(
    record: ProcessRecord,
    *,
    timeout_s: float,
    path: str | None = None,
    headers: dict[str, str] | None = None,
    popen: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll `GET url+path` until 200; `LaunchError` (with the log tail) on exit or timeout."""
    url = f"{record.url}{path or record.spec.health_path}"
    last = "no answer yet"

    with httpx.Client(timeout=10.0) as http:

        def ok() -> bool:
            nonlocal last
            try:
                resp = http.get(url, headers=headers)
            except httpx.TransportError as exc:
                last = repr(exc)
                return False
            last = f"HTTP {resp.status_code}"
            return resp.status_code == 200

        wait_healthy(record, ok, timeout_s=timeout_s, popen=popen, what=lambda: f"{url} ({last})")
