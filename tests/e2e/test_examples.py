"""Every launcher in `examples/` runs as its own Python process against the session's real stack
(Prefect server, deployed eval-point with a process worker, CPU fleet behind sglang-router), and
prints what it promises: measured points whose weight version is their step, skips with reasons,
miles-shaped results. One example also runs `--self-contained` (its own server, worker, fleet)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploykit import Deployed
from tests.pointkit import CpuFleet

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
POINT = re.compile(r"^point (.*)$", re.MULTILINE)


def run_example(name: str, *args: str, timeout: float = 240) -> tuple[str, dict[int, dict[str, str]]]:
    """Run `examples/<name>`; its stdout and its `point step=N k=v ...` lines by step."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert out.returncode == 0, f"{name} exited {out.returncode}\n{out.stdout}\n{out.stderr[-4000:]}"
    points = {}
    for line in POINT.findall(out.stdout):
        fields = dict(kv.split("=", 1) for kv in line.split())
        points[int(fields["step"])] = fields
    return out.stdout, points


@pytest.fixture
def on_stack(deployed: Deployed, cpu_fleet: CpuFleet, tiny_model: Path, tmp_path: Path) -> list[str]:
    """Arguments that point an example at the session's stack."""
    return ["--api-url", deployed.api_url, "--model-path", str(tiny_model),
            "--fleet-state", str(cpu_fleet.state_file), "--work-dir", str(tmp_path)]  # fmt: skip


def assert_measured_at_step(point: dict[str, str], step: int) -> None:
    assert point["state"] == "measured", point
    assert point["weight_version"] == str(step) and point["mixed"] == "0", point
    assert {"arith_add", "arith_sub"} <= point.keys(), point


def test_fleet_posture_pytorch_loop(on_stack: list[str]) -> None:
    stdout, points = run_example("fleet_posture_pytorch_loop.py", *on_stack, "--steps", "4", "--every", "2")
    assert sorted(points) == [2, 4], stdout
    for step, point in points.items():
        assert_measured_at_step(point, step)
    assert stdout.count("point requested") == 2, stdout


def test_shared_posture_gate(on_stack: list[str]) -> None:
    stdout, points = run_example("shared_posture_gate.py", *on_stack, "--steps", "2", "--every", "2")
    assert sorted(points) == [2], stdout
    assert_measured_at_step(points[2], 2)
    assert points[2]["gate_open"] == "True" and points[2]["gate_closed_times"] == "1", stdout


def test_external_backend(on_stack: list[str]) -> None:
    stdout, points = run_example("external_backend.py", *on_stack)
    assert sorted(points) == [10, 11], stdout
    assert_measured_at_step(points[10], 10)  # the reference backend's own CPU engine, pinned to "10"
    assert points[11]["state"] == "skipped" and points[11]["reason"] == "quota", stdout


def test_miles_adapter(on_stack: list[str]) -> None:
    stdout, points = run_example("miles_adapter.py", *on_stack)
    assert sorted(points) == [4, 8], stdout
    assert_measured_at_step(points[4], 4)
    assert points[4]["samples"] == "16", stdout  # 8 prompts per dataset, one sample each
    assert points[8]["state"] == "skipped" and points[8]["reason"] == "ckpt_missing", stdout


def test_watch_checkpoints(on_stack: list[str]) -> None:
    stdout, points = run_example("watch_checkpoints.py", *on_stack)
    assert "tick 1: step_10=requested step_20=requested step_30=not_ready" in stdout, stdout
    assert "tick 2: step_10=exists step_20=exists step_30=not_ready" in stdout, stdout
    assert sorted(points) == [10, 20], stdout
    for step, point in points.items():
        assert_measured_at_step(point, step)
