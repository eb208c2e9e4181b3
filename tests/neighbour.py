"""A second, unprivileged local user for tests of local attacks (a hostile neighbour on a shared node).

CI runs as root: the session fixture `neighbour` creates the user `pe-neighbour` (no home, no
shell) once and yields its ids; without root the tests that need it skip, naming why. Attacks run
as that user through `run_as`, with the system Python and the stdlib only (the neighbour cannot
read this checkout's virtualenv, and needs nothing from it).

`shared_dir` is a world-traversable directory (mode 1777, like /tmp) that tests place the
product's runtime paths under, so that a refused attack is refused by the product's own controls
(its 0700 directory, 0600 socket, peer-uid check), never by the 0700 pytest tmp directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

NAME = "pe-neighbour"
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"


@dataclass(frozen=True)
class Neighbour:
    name: str
    uid: int
    gid: int


def _ensure_user() -> Neighbour:
    try:
        entry = pwd.getpwnam(NAME)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
                       check=True, capture_output=True, text=True)
        entry = pwd.getpwnam(NAME)
    return Neighbour(NAME, entry.pw_uid, entry.pw_gid)


@pytest.fixture(scope="session")
def neighbour() -> Neighbour:
    if os.geteuid() != 0:
        pytest.skip("tests of local attacks create a second user and need root (CI runs as root)")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: cannot create the second user for local-attack tests")
    return _ensure_user()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A fresh world-traversable directory (1777) under /tmp; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="pe-shared-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_as(who: Neighbour, code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run `python3 -c code args...` as the neighbour (system Python, minimal environment)."""
    return subprocess.run([SYSTEM_PYTHON, "-c", code, *args], user=who.uid, group=who.gid, extra_groups=[],
                          env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}, capture_output=True, text=True,
                          timeout=timeout, cwd="/")
