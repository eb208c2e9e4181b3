"""`LocalStack` starts the warm-start fork server and the backend host beside its worker and stops
them by PID (the host disposing its backends)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from app.stack import LocalStack
from app.warm_start import SOCKET_ENV
from pinned_eval.backend_host import HOST_ENV, evaluate_hosted, host_health
from pinned_eval.external import EvalInput
from pinned_eval.processes import pid_alive
from tests.hosted_backends import read_lifecycle
from tests.pointkit import SMALL_SUITE

pytestmark = pytest.mark.e2e


def test_worker_up_starts_the_fork_server_and_down_stops_it(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path / "stack")
    log = str(tmp_path / "lifecycle.jsonl")
    stack.server_up()
    try:
        worker_pid = stack.worker_up()
        state = stack.state()
        assert state.warm_pid is not None and pid_alive(state.warm_pid)
        assert stack.warm_socket().exists(), "the fork server listens before the worker starts"
        worker_env = psutil.Process(worker_pid).environ()
        assert worker_env[SOCKET_ENV] == str(stack.warm_socket())
        assert worker_env[HOST_ENV] == str(stack.backend_socket()), "flow runs inherit the host's socket"
        assert host_health(stack.backend_socket())["pid"] == state.backend_host_pid
        assert stack.worker_up() == worker_pid and stack.state().warm_pid == state.warm_pid  # idempotent
        assert stack.state().backend_host_pid == state.backend_host_pid
        inp = EvalInput(run="exp42", step=3, hf_dir="/s", suite=SMALL_SUITE)
        evaluate_hosted(stack.backend_socket(), "tests.hosted_backends:LifecycleBackend", {"log": log}, "/s", inp)
    finally:
        stopped = stack.down()
    assert any(s.startswith("warm-start ") for s in stopped), stopped
    assert any(s.startswith("backend-host ") for s in stopped), stopped
    assert not pid_alive(state.warm_pid) and not stack.warm_socket().exists()
    assert state.backend_host_pid and not pid_alive(state.backend_host_pid) and not stack.backend_socket().exists()
    assert [e["event"] for e in read_lifecycle(log)] == ["init", "pin", "evaluated", "dispose"], "disposed at down"
    assert stack.state().warm_pid is None and stack.state().backend_host_pid is None
