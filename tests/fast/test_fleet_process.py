"""Fleet process handling with real (tiny, non-server) processes: groups, PID-reuse guard, state file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pinned_eval.fleet.launcher import FleetState, LaunchedFleet, launch_fleet
from pinned_eval.processes import (
    LaunchError,
    ProcessSpec,
    free_port,
    is_running,
    start_process,
    stop_process,
    wait_http_ok,
)

# A parent that starts a child (same process group), then both sleep.
FAMILY = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
)


def spec(code: str) -> ProcessSpec:
    return ProcessSpec(role="engine", command=[sys.executable, "-c", code], port=free_port())


def group_members(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    record, _ = start_process(spec(FAMILY), tmp_path / "p.log")
    for _ in range(500):  # wait for the child to exist
        if len(group_members(record.pid)) == 2:
            break
        time.sleep(0.02)
    assert len(group_members(record.pid)) == 2 and record.pid != os.getpgid(0)
    stop_process(record, grace_s=5)
    assert group_members(record.pid) == [] and not is_running(record)
    stop_process(record)  # already gone: a no-op


def test_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    record, popen = start_process(spec("import time; time.sleep(60)"), tmp_path / "p.log")
    stranger = record.model_copy(update={"create_time": record.create_time - 1000})  # "another process"
    try:
        assert not is_running(stranger)
        stop_process(stranger, grace_s=1)
        assert is_running(record)
    finally:
        stop_process(record, grace_s=5)
    assert popen.wait(timeout=5) is not None


def test_wait_reports_an_early_exit_with_the_log_tail(tmp_path: Path) -> None:
    record, popen = start_process(spec("import sys; print('engine blew up'); sys.exit(3)"), tmp_path / "p.log")
    with pytest.raises(LaunchError, match="engine blew up"):
        wait_http_ok(record, timeout_s=30, popen=popen)


def test_failed_launch_stops_what_it_started_and_removes_the_state_file(tmp_path: Path) -> None:
    healthy_enough = spec("import time; time.sleep(60)")  # never answers HTTP, stays alive
    dying = spec("import sys; print('bad model path'); sys.exit(2)")
    state = tmp_path / "fleet.json"
    with pytest.raises(LaunchError) as err:
        launch_fleet([dying, healthy_enough], log_dir=tmp_path / "logs", state_file=state, ready_timeout_s=30)
    assert "bad model path" in str(err.value)
    assert not state.exists()
    logs = sorted((tmp_path / "logs").glob("engine-*.log"))
    assert len(logs) == 2


def test_state_file_round_trip_is_private_and_revives_by_record(tmp_path: Path) -> None:
    record, _ = start_process(spec("import time; time.sleep(60)"), tmp_path / "p.log")
    state_file = tmp_path / "fleet" / "fleet.json"
    fleet = LaunchedFleet(FleetState(engines=[record], log_dir=str(tmp_path)), state_file)
    fleet.save()
    try:
        assert stat.S_IMODE(state_file.stat().st_mode) == 0o600  # commands may carry API keys
        again = LaunchedFleet.load(state_file)
        assert again.engine_urls == [record.url] and again.router_url is None
        assert again.manages(record.url + "/") and not again.manages("http://127.0.0.1:1")
        assert again.running() == {f"engine {record.url}": True}
        again.stop()
        assert not state_file.exists() and not is_running(record)
    finally:
        stop_process(record, grace_s=1)


def test_cpu_engine_command_matches_the_engine_cli() -> None:
    """The launcher builds `python -m engine ...` without importing `engine`; both sides agree."""
    from engine.launch import EngineArgs
    from pinned_eval.fleet.cpu_engine import CpuEngineArgs, engine_command

    assert CpuEngineArgs.model_fields.keys() == EngineArgs.model_fields.keys()
    args = CpuEngineArgs(model_path="/m", port=4321, api_key="k", context_length=64, threads=2)
    cmd = engine_command(args, python="/py", extra_args=["--max-batch-size", "8"])
    assert cmd[:3] == ["/py", "-m", "engine"] and cmd[-2:] == ["--max-batch-size", "8"]
    env = {**os.environ, "COLUMNS": "200"}
    help_text = subprocess.run(
        [sys.executable, "-m", "engine", "--help"], capture_output=True, text=True, timeout=120, env=env
    ).stdout
    for flag in (a for a in cmd[3:] if a.startswith("--")):
        assert flag in help_text, flag


def test_cpu_fleet_specs_pass_the_tool_call_parser() -> None:
    from pinned_eval.fleet.launcher import cpu_engine_specs

    with_parser = cpu_engine_specs("/m", 2, tool_call_parser="hermes")
    assert all(s.command[s.command.index("--tool-call-parser") + 1] == "hermes" for s in with_parser)
    assert all("--tool-call-parser" not in s.command for s in cpu_engine_specs("/m", 1))
