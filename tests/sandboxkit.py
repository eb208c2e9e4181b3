"""The bwrap sandbox for tests: its system requirements, and the check that a run left nothing.

`scripts/ci-services.sh` installs bubblewrap and creates the sandbox user `pe-sandbox` (CI runs
as root). `require_bwrap()`, which each test module's `sandbox` fixture calls, fails as root when
bwrap is missing (the setup should have installed it), creates `pe-sandbox` when missing (as
`tests/neighbour.py` creates its user), and skips, naming why, only where bwrap is missing and
this user cannot install it.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import subprocess

import psutil
import pytest

from pinned_eval.sandbox import BwrapSandbox, RunResult
from pinned_eval.sandbox.base import namespace_members
from pinned_eval.sandbox.bwrap import SANDBOX_USER


def ensure_sandbox_user() -> int:
    try:
        return pwd.getpwnam(SANDBOX_USER).pw_uid
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SANDBOX_USER],
                       check=True, capture_output=True, text=True)
        return pwd.getpwnam(SANDBOX_USER).pw_uid


@functools.cache
def require_bwrap() -> BwrapSandbox:
    if shutil.which("bwrap") is None:
        if os.geteuid() == 0:
            pytest.fail("bubblewrap (bwrap) is not installed: run scripts/ci-services.sh (CI does)")
        pytest.skip("bubblewrap (bwrap) is not installed and installing it needs root (CI installs it)")
    if os.geteuid() == 0:
        ensure_sandbox_user()
    return BwrapSandbox()


def sandbox_uid_processes() -> list[int]:
    """Live (non-zombie) processes of the sandbox user; [] when the worker is not root (no such user in use)."""
    if os.geteuid() != 0:
        return []
    uid = pwd.getpwnam(SANDBOX_USER).pw_uid
    out = []
    for proc in psutil.process_iter(["uids", "status"]):
        if proc.info["uids"] is not None and proc.info["uids"].real == uid and proc.info["status"] != "zombie":
            out.append(proc.pid)
    return out


def assert_nothing_left(result: RunResult) -> None:
    """The run's pid namespace is empty and no process of the sandbox user runs."""
    assert result.pid_namespace is not None
    assert namespace_members(result.pid_namespace) == []
    assert sandbox_uid_processes() == []
