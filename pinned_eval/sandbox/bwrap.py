"""The default sandbox: bubblewrap (`bwrap`) under rlimits, as an unprivileged uid.

What a run sees and may do (each point has a test in tests/fast/test_sec_sandbox.py):
- **no network**: its own network namespace, whose loopback has nothing listening (the worker's
  Prefect API, engines and router on 127.0.0.1 are unreachable); also its own pid, ipc, uts,
  user and (where possible) cgroup namespaces, and no further user namespaces (`--disable-userns`);
- **filesystem**: read-only `/usr` (with the merged-usr `/bin`, `/lib`, `/lib64`, `/sbin` links),
  `/etc/ld.so.cache`, a private `/proc` (its own processes only) and a minimal `/dev`; `ro_binds`
  adds read-only directories (e.g. a virtualenv with numpy). Nothing else of the host: no home,
  no `PINNED_EVAL_HOME` or its credential, no `/etc/passwd`, no `/tmp`, no project checkout;
- **one writable place**: `/work`, a fresh tmpfs of `disk_mb` (cwd, `HOME` and `TMPDIR`); `/`
  and `/dev` are remounted read-only; files given to `run` are copied in (0600) from memfds;
- **uid**: as root the run starts as the dedicated user `pe-sandbox` (its own uid, which no
  other process has), so RLIMIT_NPROC holds and the neighbour cannot signal, ptrace or read it
  (`/proc/<pid>/root`); as a normal user bwrap's user namespace maps the worker's uid to 65534
  inside, and RLIMIT_NPROC is set to the uid's current task count plus `processes`;
- **limits**: RLIMIT_AS, CPU, NPROC, FSIZE, NOFILE and no core files (via `prlimit`, before
  bwrap), the wall deadline and the output cap (`base.collect`);
- **no survivors**: `--die-with-parent` (bwrap and the sandbox die with the worker),
  `--new-session` (no TIOCSTI into a terminal); a kill takes the whole pid namespace, and the run
  returns only once nothing of it is left. The program is its namespace's pid 1 (`--as-pid-1`):
  bwrap then reaps it itself (its own init would be left a zombie for the host's init to reap,
  counting against RLIMIT_NPROC until then) and its CPU time reaches `RunResult.cpu_s`. As pid 1
  it ignores SIGXCPU, so the CPU limit ends it with SIGKILL one CPU second later (`cpu`).

Known limits: concurrent runs share the `pe-sandbox` uid, so they share RLIMIT_NPROC (a fork bomb
in one can make another's start fail, `start_failed`); no seccomp filter (the kernel's syscall
surface is reachable from inside the namespaces).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

from pinned_eval.sandbox.base import (
    Outcome,
    RunResult,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    check_files,
    classify,
    collect,
    command_of,
    decode,
    prlimit_argv,
    reap_namespace,
    tasks_of_uid,
)

WORK = "/work"
MIN_VERSION = (0, 8, 0)  # --disable-userns (Debian 12 ships 0.8.0)
SANDBOX_USER = "pe-sandbox"
INSIDE_ID = "65534"  # nobody, inside the user namespace
_SYSTEM_LINKS = ("/bin", "/lib", "/lib64", "/sbin")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK, "TMPDIR": WORK, "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1"}


class BwrapOptions(BaseModel):
    """How the bwrap backend runs (limits are per run: `SandboxLimits`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bwrap: str = "bwrap"
    prlimit: str = "prlimit"
    python: str = "/usr/bin/python3"
    user: str = SANDBOX_USER
    ro_binds: tuple[str, ...] = ()

    @field_validator("ro_binds")
    @classmethod
    def _absolute(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not os.path.isabs(path) or os.path.normpath(path) != path or path == "/":
                raise ValueError(f"{path!r} must be an absolute, normalized directory other than /")
        return value


def install_hint() -> str:
    return ("install the Debian package bubblewrap (scripts/ci-services.sh does), or opt in to the "
            "unsafe_subprocess sandbox explicitly")


class Running:
    """A started bwrap run: `child_pid` (host PID of the program, its namespace's pid 1) and
    `pid_namespace`. The deadline and the output cap are enforced by `wait()`: always call it
    (after `kill()` if the run is abandoned)."""

    def __init__(self, popen: subprocess.Popen[bytes], status_r: int, limits: SandboxLimits, started: float):
        self.popen, self._status_r, self.limits, self.started = popen, status_r, limits, started
        self.status = _read_first_line(status_r, started + limits.wall_s)
        info = _json_lines(self.status)
        self.child_pid: int | None = info.get("child-pid")
        self.pid_namespace: int | None = info.get("pid-namespace")
        self._result: RunResult | None = None

    def kill(self) -> None:
        """SIGKILL the run now (its namespace follows); `wait()` then returns its result."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def wait(self) -> RunResult:
        if self._result is not None:
            return self._result
        got = collect(self.popen, limits=self.limits, started=self.started, status_fd=self._status_r)
        os.close(self._status_r)
        if got.killed_for is not None and self.pid_namespace is not None:
            reap_namespace(self.pid_namespace)
        status = _json_lines(self.status + got.status)
        stderr = decode(got.stderr)
        if got.killed_for is not None:
            outcome = got.killed_for
        elif "exit-code" not in status:  # bwrap failed before or while starting the program
            outcome = Outcome.START_FAILED
        else:
            outcome = classify(got.exit_code, stderr, got.cpu_s, self.limits, shell_style=True)
        self._result = RunResult(
            backend="bwrap", unsafe=False, outcome=outcome,
            exit_code=status.get("exit-code", got.exit_code), stdout=decode(got.stdout), stderr=stderr,
            truncated=got.truncated, wall_s=got.wall_s, cpu_s=got.cpu_s, pid_namespace=self.pid_namespace,
        )
        return self._result


class BwrapSandbox:
    """`Sandbox` backend `bwrap` (the default); see the module docstring for what a run may do."""

    name = "bwrap"
    unsafe = False

    def __init__(self, options: BwrapOptions | None = None):
        self.options = options or BwrapOptions()
        self._bwrap = shutil.which(self.options.bwrap)
        self._prlimit = shutil.which(self.options.prlimit)
        if self._bwrap is None:
            raise SandboxUnavailable(f"sandbox bwrap: {self.options.bwrap!r} is not installed: {install_hint()}")
        if self._prlimit is None:
            raise SandboxUnavailable(f"sandbox bwrap: {self.options.prlimit!r} (util-linux) is not installed")
        version = bwrap_version(self._bwrap)
        if version < MIN_VERSION:
            raise SandboxUnavailable(
                f"sandbox bwrap: {self._bwrap} is version {'.'.join(map(str, version))}; "
                f"{'.'.join(map(str, MIN_VERSION))} or newer is needed (--disable-userns)"
            )
        self._uid: int | None = None
        self._gid: int | None = None
        if os.geteuid() == 0:
            try:
                entry = pwd.getpwnam(self.options.user)
            except KeyError:
                raise SandboxUnavailable(
                    f"sandbox bwrap: running as root needs the unprivileged user {self.options.user!r}; create it "
                    f"with `useradd --system --no-create-home --shell /usr/sbin/nologin {self.options.user}` "
                    "(scripts/ci-services.sh does)"
                ) from None
            if entry.pw_uid == 0 or entry.pw_gid == 0:
                raise SandboxUnavailable(f"sandbox bwrap: user {self.options.user!r} must not be root")
            self._uid, self._gid = entry.pw_uid, entry.pw_gid

    def run(
        self,
        code: str | None = None,
        *,
        argv: list[str] | None = None,
        files: Mapping[str, bytes | str] | None = None,
        stdin: bytes = b"",
        limits: SandboxLimits | None = None,
    ) -> RunResult:
        return self.start(code, argv=argv, files=files, stdin=stdin, limits=limits).wait()

    def start(
        self,
        code: str | None = None,
        *,
        argv: list[str] | None = None,
        files: Mapping[str, bytes | str] | None = None,
        stdin: bytes = b"",
        limits: SandboxLimits | None = None,
    ) -> Running:
        limits = limits or SandboxLimits()
        command = command_of(code, argv, self.options.python)
        contents = check_files(files, code)
        fds: list[int] = []
        try:
            file_args: list[str] = []
            for parent in sorted({str(Path(n).parent) for n in contents} - {"."}, key=lambda p: p.count("/")):
                for i in range(1, len(Path(parent).parts) + 1):
                    file_args += ["--perms", "0700", "--dir", f"{WORK}/{'/'.join(Path(parent).parts[:i])}"]
            for name, data in contents.items():
                fd = _memfd(name, data)
                fds.append(fd)
                file_args += ["--perms", "0600", "--file", str(fd), f"{WORK}/{name}"]
            status_r, status_w = os.pipe()
            fds.append(status_w)
            passed = list(fds)  # the file memfds (bwrap copies them in) and its status pipe
            stdin_fd = _memfd("stdin", stdin)
            fds.append(stdin_fd)
            argv_full = [
                *prlimit_argv(self._prlimit or "prlimit", limits, self._nproc(limits)),
                *self.bwrap_args(limits, file_args, status_w), "--", *command,
            ]
            started = time.monotonic()
            try:
                popen = subprocess.Popen(
                    argv_full, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, cwd="/",
                    start_new_session=True, pass_fds=passed, close_fds=True,
                    user=self._uid, group=self._gid, extra_groups=[] if self._uid is not None else None,
                )
            except OSError as exc:
                os.close(status_r)
                raise SandboxError(f"sandbox bwrap: cannot start {argv_full[0]}: {exc}") from None
        finally:
            for fd in fds:
                os.close(fd)
        return Running(popen, status_r, limits, started)

    def bwrap_args(self, limits: SandboxLimits, file_args: list[str], status_fd: int) -> list[str]:
        args = [self._bwrap or "bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--as-pid-1",
                "--uid", INSIDE_ID, "--gid", INSIDE_ID, "--hostname", "sandbox", "--die-with-parent", "--new-session",
                "--clearenv"]
        for key, value in _ENV.items():
            args += ["--setenv", key, value]
        args += ["--ro-bind", "/usr", "/usr"]
        for link in _SYSTEM_LINKS:
            if os.path.islink(link):
                args += ["--symlink", os.readlink(link), link]
            elif os.path.isdir(link):
                args += ["--ro-bind", link, link]
        args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        for path in self.options.ro_binds:
            args += ["--ro-bind", path, path]
        args += ["--proc", "/proc", "--dev", "/dev",
                 "--size", str(limits.disk_mb << 20), "--perms", "0700", "--tmpfs", WORK, *file_args,
                 "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK, "--json-status-fd", str(status_fd)]
        return args

    def _nproc(self, limits: SandboxLimits) -> int:
        """As the dedicated user: `processes`. As the worker's own uid: its live tasks plus `processes`."""
        if self._uid is not None:
            return limits.processes
        return tasks_of_uid(os.getuid()) + limits.processes


def bwrap_version(bwrap: str) -> tuple[int, ...]:
    """`bwrap --version` ("bubblewrap 0.8.0") as a tuple; (0,) when it does not answer so."""
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(part) for part in out.split()[-1].split("."))
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return (0,)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(f"sandbox-{os.path.basename(name)}", 0)  # no MFD_CLOEXEC: passed to bwrap
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_first_line(fd: int, deadline: float) -> bytes:
    """bwrap's first status document (child pid, namespaces), or what came before EOF/deadline."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf


def _json_lines(data: bytes) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict):
                out.update({k: v for k, v in doc.items() if isinstance(v, int)})
    return out
