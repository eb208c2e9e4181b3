"""`LocalStack` starts the warm-start fork server beside its worker and stops both by PID."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from app.stack import LocalStack
from app.warm_start import SOCKET_ENV
from pinned_eval.processes import pid_alive

pytestmark = pytest.mark.e2e


def test_worker_up_starts_the_fork_server_and_down_stops_it(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path / "stack")
    stack.server_up()
    try:
        worker_pid = stack.worker_up()
        state = stack.state()
        assert state.warm_pid is not None and pid_alive(state.warm_pid)
        assert stack.warm_socket().exists(), "the fork server listens before the worker starts"
        assert psutil.Process(worker_pid).environ()[SOCKET_ENV] == str(stack.warm_socket())
        assert stack.worker_up() == worker_pid and stack.state().warm_pid == state.warm_pid  # idempotent
    finally:
        stopped = stack.down()
    assert any(s.startswith("warm-start ") for s in stopped), stopped
    assert not pid_alive(state.warm_pid) and not stack.warm_socket().exists()
    assert stack.state().warm_pid is None
