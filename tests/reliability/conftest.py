"""Fixtures of the reliability suite: local S3 (moto), a size-limited staging disk, point helpers.

Every server binds 127.0.0.1 on an OS-chosen port; whatever a fixture starts it stops by PID or
handle. Session fixtures (the Prefect server, the CPU fleet, moto) are shared with the rest of
the test tree through `tests/conftest.py`.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.s3_fixtures import s3_bucket, s3_server  # noqa: F401 - fixtures


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a 256 KiB tmpfs (root can mount here); skipped where `mount` is refused."""
    mnt = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}); the RLIMIT_FSIZE test covers it")
    try:
        yield mnt
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@pytest.fixture(scope="session")
def fleet_reaper(cpu_fleet):  # type: ignore[no-untyped-def]
    """Tests that SIGKILL an engine of the session fleet get it revived under a new PID, which the
    session fixture does not know: at session end stop what the state file records (before the
    session fleet's own teardown, which then finds its old PIDs gone)."""
    yield cpu_fleet
    from pinned_eval.fleet.launcher import LaunchedFleet

    if cpu_fleet.state_file.exists():
        LaunchedFleet.load(cpu_fleet.state_file).stop()
