"""Operator verbs end to end: request → Failed → rerun in place → Completed; status, report; janitor.

Real Prefect server, the deployed eval-point with a process worker, the CPU fleet behind
sglang-router. The CLI runs in this process (typer's runner) against the session's server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from PIL import Image
from prefect import get_client
from prefect.states import Failed
from typer.testing import CliRunner

from app.cli import app
from blocks import FleetBlock, StagingBlock
from flows.eval_point import eval_point
from flows.janitor import last_activity
from flows.point_runs import point_flow_runs
from pinned_eval.events import EVENT_FAILED, point_resource
from pinned_eval.sinks import JsonlSink
from tests.deploykit import REPO, Deployed, wait_for
from tests.eventkit import related_flow_runs, settled_events
from tests.pointkit import SMALL_SUITE, CpuFleet, PointEnv, save_point_blocks, write_step_snapshot

pytestmark = pytest.mark.e2e

EXPLODE_ONCE = SMALL_SUITE.model_copy(
    update={"defaults": SMALL_SUITE.defaults.model_copy(update={"reward": "custom:tests.rewards:explode_once"})}
)


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def cli_process(*args: str, timeout: float = 300) -> tuple[int, str, str]:
    """The real `pinned-eval` in a subprocess, on the session's server (its URL and credential
    in the inherited environment: exported variables win over any home)."""
    out = subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO, env=dict(os.environ),
                         capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout, out.stderr


def block_opts(env: PointEnv) -> list[str]:
    return [opt for name, value in env.blocks.items() for opt in (f"--{name}", value)]


def staged(env: PointEnv, step: int, tiny: Path) -> str:
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)
    return write_step_snapshot(tiny, dest)


@pytest.fixture
def explode_env(prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path) -> PointEnv:
    fleet = FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))
    return save_point_blocks(tmp_path, fleet, suite=EXPLODE_ONCE)


def test_rerun_retries_a_failed_point_in_place_and_status_shows_both_attempts(
    explode_env: PointEnv, deployed: Deployed, tiny_model: Path, tmp_path: Path
):
    env = explode_env
    dest = staged(env, 5, tiny_model)
    code, out, err = cli_process("request", "--run", env.run, "--step", "5", "--source", f"staged:{dest}",
                                 *block_opts(env), "--wait", "--timeout", "240")
    assert code == 4, out + err  # EXIT_FAILED
    assert "Failed" in out.splitlines()[-1], out

    code, out = cli("status", "--run", env.run, "--json")
    assert code == 0, out
    [point] = json.loads(out)["points"]
    assert (point["step"], point["outcome"], point["reason"], len(point["attempts"])) == (5, "failed", "crashed", 1)
    first_id = point["flow_run_id"]
    assert (Path(dest) / ".retired").exists()  # in the keep-ring after the failed point

    code, out = cli("rerun", "--run", env.run, "--step", "5", "--wait", "--timeout", "240")
    assert code == 0, out
    assert f"retrying {env.run}/step-5 in place: {first_id}" in out
    assert out.splitlines()[-1].startswith(f"{env.run}/step-5 {first_id}: Completed"), out

    code, out = cli("status", "--run", env.run, "--json")
    doc = json.loads(out)
    [point] = doc["points"]
    assert point["outcome"] == "measured" and point["weight_version"] == "5" and point["flow_run_id"] == first_id
    assert [(a["flow_run_id"], a["state_type"]) for a in point["attempts"]] == [
        (first_id, "FAILED"), (first_id, "COMPLETED")
    ]
    assert set(point["scores"]) == {"arith_add", "arith_sub"}
    with get_client(sync_client=True) as c:
        assert c.read_flow_run(first_id).run_count == 2
    rows = JsonlSink(env.jsonl).read(env.run)
    assert {(r.state, r.flow_run_id) for r in rows} == {("measured", first_id)}  # the rerun replaced the row

    code, table = cli("status", "--run", env.run)
    assert code == 0 and "attempt 1: Failed" in table and "attempt 2: Completed" in table, table

    code, out = cli("rerun", "--run", env.run, "--step", "5")
    assert code == 1 and "was measured" in out  # a measured point needs --force

    code, out = cli("report", "--run", env.run, "--out", str(tmp_path / "report.png"))
    assert code == 0, out
    with Image.open(tmp_path / "report.png") as img:
        assert img.format == "PNG" and img.size == (1000, 550)


def test_rerun_of_a_skipped_point_is_a_new_run_once_its_snapshot_exists(
    point_env: PointEnv, deployed: Deployed, tiny_model: Path
):
    env = point_env
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, 8)
    state = eval_point(**env.params(8, source={"kind": "staged", "path": dest}), return_state=True)
    assert state.name == "Skipped" and state.message.startswith("ckpt_missing"), state.message
    code, out = cli("rerun", "--run", env.run, "--step", "8")
    assert code == 1 and f"staged snapshot {dest}" in out and "not available" in out, out

    write_step_snapshot(tiny_model, dest)  # the operator re-exported the step
    code, out = cli("rerun", "--run", env.run, "--step", "8", "--wait", "--timeout", "240")
    assert code == 0 and "as a new run" in out, out
    assert ": Completed (completed)" in out.splitlines()[-1], out
    code, out = cli("status", "--run", env.run, "--json")
    [point] = json.loads(out)["points"]
    assert point["outcome"] == "measured" and point["reason"] is None
    assert [a["state_name"] for a in point["attempts"]] == ["Skipped", "Completed"]
    assert len({a["flow_run_id"] for a in point["attempts"]}) == 2  # a new run, not a retry
    assert point["flow_run_name"] == f"{env.run}/step-8"


def test_a_mistyped_source_is_skipped_with_exit_3_and_the_right_one_needs_force_new(
    point_env: PointEnv, deployed: Deployed, tiny_model: Path, tmp_path: Path
):
    env = point_env
    typo = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, 9)
    Path(typo).mkdir(parents=True)  # exists, but holds no snapshot
    code, out, err = cli_process("request", "--run", env.run, "--step", "9", "--source", f"staged:{typo}",
                                 *block_opts(env), "--wait", "--timeout", "240")
    assert code == 3, out + err  # EXIT_SKIPPED
    assert f"{env.run}/step-9" in out.splitlines()[-1] and ": Skipped (completed) ckpt_missing" in out, out

    code, out = cli("status", "--run", env.run)  # the reason without -v
    [line] = [ln for ln in out.splitlines() if ln.startswith("step 9: ")]
    assert line.startswith("step 9: skipped ckpt_missing: ") and typo in line, out

    right = write_step_snapshot(tiny_model, str(tmp_path / "ckpt" / "step_9"))
    code, out, err = cli_process("request", "--run", env.run, "--step", "9", "--source", f"hf:{right}",
                                 *block_opts(env))
    assert code == 2, out + err
    assert f"with source staged:{typo}, not hf:{right}; nothing was sent: `--force-new` requests a fresh point" in err
    code, out, err = cli_process("request", "--run", env.run, "--step", "9", "--source", f"hf:{right}",
                                 *block_opts(env), "--force-new", "--wait", "--timeout", "240")
    assert code == 0, out + err
    assert ": Completed (completed)" in out.splitlines()[-1], out
    code, out = cli("status", "--run", env.run, "--json")
    [point] = json.loads(out)["points"]
    assert (point["outcome"], point["weight_version"], len(point["attempts"])) == ("measured", "9", 2)

    gone = tmp_path / "ckpt" / "step_10"
    gone.mkdir()  # no marker: skipped; then deleted, so a rerun cannot use it
    code, out = cli("request", "--run", env.run, "--step", "10", "--source", f"hf:{gone}", *block_opts(env),
                    "--wait", "--timeout", "240")
    assert code == 3, out
    gone.rmdir()
    code, out = cli("rerun", "--run", env.run, "--step", "10")
    assert code == 1
    assert out.strip() == (
        f"error: hf source of {env.run}/step-10 is gone ({gone}); it cannot be exported again. Request the step "
        f"with a source that exists: `pinned-eval request --run {env.run} --step 10 --source hf:PATH --force-new`"
    )


def test_rerun_and_status_refuse_what_they_cannot_do(point_env: PointEnv, tmp_path: Path):
    code, out = cli("rerun", "--run", point_env.run, "--step", "9")
    assert code == 1 and "no flow run" in out
    code, out = cli("status", "--run", point_env.run)
    assert code == 1 and "no eval point" in out
    code, out = cli("report", "--run", point_env.run, "--out", str(tmp_path / "r.svg"))
    assert code == 2 and "must end in .png or .html" in out
    code, out = cli("request", "--run", point_env.run, "--step", "1", "--source", "weird:/x")
    assert (code, out.strip()) == (2, "error: --source: 'weird:/x' must be KIND:PATH with KIND one of hf, staged, "
                                      "megatron, state_dict, lora")


def _start_point_process(env: PointEnv, step: int, dest: str, log: Path) -> subprocess.Popen[bytes]:
    params = env.params(step, source={"kind": "staged", "path": dest})
    code = "import json, sys; from flows.eval_point import eval_point; eval_point(**json.loads(sys.argv[1]))"
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-c", code, json.dumps(params)], cwd=REPO, env=dict(os.environ),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _task_started(run: str, task: str):  # type: ignore[no-untyped-def]
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as c:
        for fr in point_flow_runs(c, run):
            tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [fr.id]}))
            if any(t.name.startswith(task) for t in tasks):
                return fr
    return None


def test_janitor_crashes_a_point_whose_host_is_gone(slow_point_env: PointEnv, tiny_model: Path, tmp_path: Path):
    env = slow_point_env  # held ~12 s in its score phase, so the kill always lands mid-point
    dest = staged(env, 3, tiny_model)
    proc = _start_point_process(env, 3, dest, tmp_path / "point.log")
    try:
        fr = wait_for(lambda: _task_started(env.run, "score"), 120, "the point to reach its score")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # host loss: no finally, no hook, nobody reports
        proc.wait(timeout=30)
    with get_client(sync_client=True) as c:
        assert c.read_flow_run(fr.id).state.is_running()  # a zombie

    code, out = cli("janitor", "--heartbeat-window", "3600", "--run", env.run, "--staging", env.blocks["staging"])
    assert code == 0 and "0 crashed, 0 retired" in out, out  # quiet, but within the window: live
    assert not (Path(dest) / ".retired").exists()

    def quiet_for(seconds: float) -> bool:
        with get_client(sync_client=True) as c:
            return (datetime.now(UTC) - last_activity(c, c.read_flow_run(fr.id))).total_seconds() > seconds

    wait_for(lambda: quiet_for(3), 30, "the zombie to be quiet for 3 s")
    code, out = cli("janitor", "--heartbeat-window", "2", "--run", env.run)
    assert code == 0, out
    assert f"crashed {env.run}/step-3 {fr.id}" in out and f"retired {dest}" in out, out
    with get_client(sync_client=True) as c:
        state = c.read_flow_run(fr.id).state
    assert state.is_crashed() and state.message.startswith("janitor: no activity"), state
    assert (Path(dest) / ".retired").exists()
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert (row.step, row.state, row.reason, row.flow_run_id) == (3, "failed", "crashed", str(fr.id))
    assert row.metrics["eval/skipped_crashed"] == 1
    [alert] = settled_events(EVENT_FAILED, point_resource(env.run, 3)["prefect.resource.id"])  # once
    assert f"prefect.flow-run.{fr.id}" in related_flow_runs(alert), alert["related"]

    code, out = cli("status", "--run", env.run, "--json")
    [point] = json.loads(out)["points"]
    assert (point["outcome"], point["reason"]) == ("crashed", "crashed")


def test_janitor_retires_snapshots_of_ended_points_only(point_env: PointEnv, tiny_model: Path):
    env = point_env
    store = StagingBlock.load(env.blocks["staging"]).staging()
    ended = staged(env, 1, tiny_model)
    fresh = staged(env, 2, tiny_model)  # written by a trainer, its request not yet delivered
    with get_client(sync_client=True) as c:  # a point that ended without retiring (e.g. its hook was lost)
        fr = c.create_flow_run(eval_point, parameters=env.params(1, source={"kind": "staged", "path": ended}),
                               name=f"{env.run}/step-1", tags=[f"run:{env.run}", "step:1"], state=Failed(message="x"))
    code, out = cli("janitor", "--run", env.run, "--staging", env.blocks["staging"])
    assert code == 0, out
    assert f"retired {ended}" in out and fresh not in out, out
    assert [(s.step, s.retired) for s in store.list(env.run)] == [(1, True), (2, False)]
    code, out = cli("janitor", "--run", env.run, "--staging", env.blocks["staging"], "--orphan-age", "0")
    assert f"retired {fresh}" in out and fr.id  # no point at all and older than --orphan-age
