"""`unsafe_subprocess`: the same rlimits, deadline and output cap, but **no isolation**.

The program sees the network, the filesystem as the sandbox user (or the worker's uid when the
worker is not root) sees it, and other processes. It exists for machines without bubblewrap and
must be chosen explicitly (`allow_unsafe=True`); every result says `unsafe=True` so the point
can report it. A child that starts its own session escapes the kill of the process group.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from pinned_eval.sandbox.base import (
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
    tasks_of_uid,
)
from pinned_eval.sandbox.bwrap import SANDBOX_USER

WARNING = "unsafe_subprocess: model-written code ran without a sandbox (no network or filesystem isolation)"


class UnsafeOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    prlimit: str = "prlimit"
    python: str = "/usr/bin/python3"
    user: str = SANDBOX_USER


class UnsafeSubprocessSandbox:
    """`Sandbox` backend `unsafe_subprocess`: refused unless `allow_unsafe=True`."""

    name = "unsafe_subprocess"
    unsafe = True

    def __init__(self, options: UnsafeOptions | None = None, *, allow_unsafe: bool = False):
        if not allow_unsafe:
            raise SandboxError(
                "sandbox unsafe_subprocess runs model-written code without isolation; it must be chosen explicitly "
                "(allow_unsafe)"
            )
        self.options = options or UnsafeOptions()
        self._prlimit = shutil.which(self.options.prlimit)
        if self._prlimit is None:
            raise SandboxUnavailable(
                f"sandbox unsafe_subprocess: {self.options.prlimit!r} (util-linux) is not installed"
            )
        self._uid: int | None = None
        self._gid: int | None = None
        if os.geteuid() == 0:  # never run model code as root: RLIMIT_NPROC would not hold either
            try:
                entry = pwd.getpwnam(self.options.user)
            except KeyError:
                raise SandboxUnavailable(
                    f"sandbox unsafe_subprocess: running as root needs the unprivileged user {self.options.user!r}"
                ) from None
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
        limits = limits or SandboxLimits()
        command = command_of(code, argv, self.options.python)
        contents = check_files(files, code)
        work = Path(tempfile.mkdtemp(prefix="pe-unsafe-sandbox-"))
        try:
            for name, data in contents.items():
                (work / name).parent.mkdir(parents=True, exist_ok=True)
                (work / name).write_bytes(data)
            if self._uid is not None:
                for path in [work, *work.rglob("*")]:
                    os.chown(path, self._uid, self._gid or -1)
            with tempfile.TemporaryFile() as stdin_file:
                stdin_file.write(stdin)
                stdin_file.seek(0)
                nproc = limits.processes if self._uid is not None else limits.processes + tasks_of_uid(os.getuid())
                started = time.monotonic()
                try:
                    popen = subprocess.Popen(
                        [*prlimit_argv(self._prlimit or "prlimit", limits, nproc), *command],
                        stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work,
                        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work),
                             "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"},
                        start_new_session=True, user=self._uid, group=self._gid,
                        extra_groups=[] if self._uid is not None else None,
                    )
                except OSError as exc:
                    raise SandboxError(f"sandbox unsafe_subprocess: cannot start {command[0]}: {exc}") from None
                got = collect(popen, limits=limits, started=started)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        stderr = decode(got.stderr)
        outcome = got.killed_for or classify(got.exit_code, stderr, got.cpu_s, limits, shell_style=False)
        return RunResult(
            backend=self.name, unsafe=True, outcome=outcome, exit_code=got.exit_code, stdout=decode(got.stdout),
            stderr=stderr, truncated=got.truncated, wall_s=got.wall_s, cpu_s=got.cpu_s, warning=WARNING,
        )
