"""Every launcher in `examples/` runs as its own Python process and prints what it promises:
measured points whose weight version is their step, skips with their reasons, miles-shaped
results, idempotent watch ticks.

They run against the session's real stack (Prefect server, deployed eval-point with a process
worker, CPU fleet behind sglang-router), and one also runs `--self-contained` (its own server,
deployments, worker and fleet, stopped when it ends). To fit the time budget, most run
concurrently (their points take turns on the fleet through its `fleet-default` lock) and each
test waits for its own process. Two run alone, first: the shared-posture example pushes weights
onto the fleet's engines itself, outside the fleet lock, as a trainer does to its own engines; the
miles adapter creates its flow runs with a single POST that a busy SQLite server can answer 503.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploykit import Deployed
from tests.pointkit import CpuFleet

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
POINT = re.compile(r"^point (.*)$", re.MULTILINE)
TIMEOUT_S = 240


class Example:
    """One example process (its own session, so it can be interrupted as a whole)."""

    def __init__(self, name: str, *args: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "examples" / name), *args],
            cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )
        self._out: tuple[str, str] | None = None
        self.run_dir: Path | None = None  # a self-contained run's directory (its state files)

    def result(self, timeout: float = TIMEOUT_S) -> tuple[str, dict[int, dict[str, str]]]:
        """Its stdout and its `point step=N k=v ...` lines by step; fails unless it exited 0."""
        if self._out is None:
            try:
                self._out = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                pytest.fail(f"{self.name} still running after {timeout}s")
        stdout, stderr = self._out
        assert self.proc.returncode == 0, f"{self.name} exited {self.proc.returncode}\n{stdout}\n{stderr[-4000:]}"
        points = {}
        for line in POINT.findall(stdout):
            fields = dict(kv.split("=", 1) for kv in line.split())
            points[int(fields["step"])] = fields
        return stdout, points

    def stop(self) -> None:
        """Ctrl-C (the example stops what it started), then SIGKILL after 60 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self._out = self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self._out = self.proc.communicate()


@pytest.fixture(scope="module")
def on_stack(deployed: Deployed, cpu_fleet: CpuFleet, tiny_model: Path) -> list[str]:
    """Arguments that point an example at the session's stack."""
    return ["--api-url", deployed.api_url, "--model-path", str(tiny_model), "--fleet-state", str(cpu_fleet.state_file)]


@pytest.fixture(scope="module")
def concurrent(on_stack: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Example]]:
    """The fleet-lock-respecting examples, started together; plus one self-contained run."""
    work = tmp_path_factory.mktemp("examples")
    own = work / "own"
    started: dict[str, Example] = {}
    try:
        for name, extra in {
            "fleet_posture_pytorch_loop.py": ["--steps", "4", "--every", "2"],
            "external_backend.py": [],
            "watch_checkpoints.py": [],
        }.items():
            started[name] = Example(name, *on_stack, "--work-dir", str(work), *extra)
        started["self-contained"] = Example(
            "fleet_posture_pytorch_loop.py", "--self-contained", "--work-dir", str(own), "--run", "own",
            "--steps", "2", "--every", "2",
        )
        started["self-contained"].run_dir = own / "own"
        yield started
    finally:
        for example in started.values():
            example.stop()
        _stop_leftovers(own / "own")


def _stop_leftovers(run_dir: Path) -> None:
    """Safety net for a self-contained run that was killed: stop what its state files record."""
    from app.stack import LocalStack
    from pinned_eval.fleet.launcher import LaunchedFleet

    if (run_dir / "fleet" / "fleet.json").exists():
        LaunchedFleet.load(run_dir / "fleet" / "fleet.json").stop()
    if (run_dir / "stack" / "stack.json").exists():
        LocalStack(run_dir / "stack").down()


def assert_measured_at_step(point: dict[str, str], step: int) -> None:
    assert point["state"] == "measured", point
    assert point["weight_version"] == str(step) and point["mixed"] == "0", point
    assert {"arith_add", "arith_sub"} <= point.keys(), point


def run_alone(name: str, *args: str) -> tuple[str, dict[int, dict[str, str]]]:
    example = Example(name, *args)
    try:
        return example.result()
    finally:
        example.stop()


def test_shared_posture_gate(on_stack: list[str], tmp_path: Path) -> None:
    stdout, points = run_alone("shared_posture_gate.py", *on_stack, "--work-dir", str(tmp_path), "--steps", "2",
                               "--every", "2")
    assert sorted(points) == [2], stdout
    assert_measured_at_step(points[2], 2)  # the live engines, at the version the trainer pushed
    assert points[2]["gate_open"] == "True" and points[2]["gate_closed_times"] == "1", stdout


def test_miles_adapter(on_stack: list[str], tmp_path: Path) -> None:
    stdout, points = run_alone("miles_adapter.py", *on_stack, "--work-dir", str(tmp_path))
    assert sorted(points) == [4, 8], stdout
    assert_measured_at_step(points[4], 4)
    assert points[4]["samples"] == "16", stdout  # 8 prompts per dataset, one sample each
    assert points[8]["state"] == "skipped" and points[8]["reason"] == "ckpt_missing", stdout


def test_fleet_posture_pytorch_loop(concurrent: dict[str, Example]) -> None:
    stdout, points = concurrent["fleet_posture_pytorch_loop.py"].result()
    assert sorted(points) == [2, 4], stdout
    for step, point in points.items():
        assert_measured_at_step(point, step)
    assert stdout.count(": point requested") == 2, stdout


def test_external_backend(concurrent: dict[str, Example]) -> None:
    stdout, points = concurrent["external_backend.py"].result()
    assert sorted(points) == [10, 11], stdout
    assert_measured_at_step(points[10], 10)  # the reference backend's own CPU engine, pinned to "10"
    assert points[11]["state"] == "skipped" and points[11]["reason"] == "quota", stdout


def test_watch_checkpoints(concurrent: dict[str, Example]) -> None:
    stdout, points = concurrent["watch_checkpoints.py"].result()
    assert "tick 1: step_10=requested step_20=requested step_30=not_ready" in stdout, stdout
    assert "tick 2: step_10=exists step_20=exists step_30=not_ready" in stdout, stdout
    assert sorted(points) == [10, 20], stdout
    for step, point in points.items():
        assert_measured_at_step(point, step)


def test_self_contained_run_starts_and_stops_its_own_stack(concurrent: dict[str, Example]) -> None:
    stdout, points = concurrent["self-contained"].result(timeout=TIMEOUT_S + 60)
    assert sorted(points) == [2], stdout
    assert_measured_at_step(points[2], 2)
    import httpx

    from app.stack import LocalStack

    [ui] = re.findall(r"Prefect UI (http://127\.0\.0\.1:\d+)", stdout)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{ui}/api/health", timeout=5)  # its server is gone
    run_dir = concurrent["self-contained"].run_dir
    assert run_dir is not None
    assert not (run_dir / "fleet" / "fleet.json").exists(), "the fleet was stopped (its state file removed)"
    state = LocalStack(run_dir / "stack").state()
    assert state.server_pid is None and state.worker_pid is None and state.warm_pid is None, state  # stopped
