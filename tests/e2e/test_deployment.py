"""The deployed eval point: triggered by `POST /api/events`, run by a real process worker."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
from prefect import get_client

from app.warm_start import CLIENT
from blocks import StagingBlock
from pinned_eval.events import BlockNames, point_event, post_events
from pinned_eval.points import PointRequest, SnapshotSource
from pinned_eval.sinks import JsonlSink
from tests.deploykit import Deployed, flow_run_process, runs_of_deployment, wait_for
from tests.pointkit import PointEnv, write_step_snapshot

pytestmark = pytest.mark.e2e


def request_point(env: PointEnv, deployed: Deployed, step: int, tiny: Path) -> str:
    store = StagingBlock.load(env.blocks["staging"]).staging()
    dest = store.path_for(env.run, step)
    write_step_snapshot(tiny, dest)
    req = PointRequest(run=env.run, step=step, source=SnapshotSource(kind="staged", path=dest))
    event = point_event(req, BlockNames(**env.blocks))
    post_events(deployed.api_url, [event])
    post_events(deployed.api_url, [event])  # a retried send: same id, same point
    return dest


def test_event_triggers_exactly_one_run_per_event_id(point_env: PointEnv, deployed: Deployed, tiny_model: Path):
    dest = request_point(point_env, deployed, 21, tiny_model)
    [fr] = wait_for(lambda: runs_of_deployment(deployed.deployment_id, point_env.run), 60, "the triggered run")
    done = wait_for(
        lambda: (r := _read(fr.id)).state.is_final() and r, 180, "the triggered run to finish", interval_s=1
    )
    assert done.state.name == "Completed", done.state.message
    assert done.name == f"{point_env.run}/step-21"
    assert done.parameters["step"] == 21 and done.parameters["source"]["path"] == dest
    assert len(runs_of_deployment(deployed.deployment_id, point_env.run)) == 1
    assert {r.state for r in JsonlSink(point_env.jsonl).read(point_env.run)} == {"measured"}
    # the flow-run process (a fork of the warm-start server) ships its logs to the server; the last
    # batch is flushed as the process exits, after the final state is set
    wait_for(lambda: any("Finished in state Completed" in m for m in _log_messages(fr.id)), 60,
             "the flow run's final log line to reach the server")


def test_sigkilled_flow_run_is_crashed_and_its_snapshot_retired(
    slow_point_env: PointEnv, deployed: Deployed, tiny_model: Path
):
    point_env = slow_point_env
    dest = request_point(point_env, deployed, 22, tiny_model)
    [fr] = wait_for(lambda: runs_of_deployment(deployed.deployment_id, point_env.run), 60, "the triggered run")
    proc = wait_for(lambda: flow_run_process(deployed.worker_pid, str(fr.id)), 60, "the flow-run process")
    wait_for(lambda: _task_started(fr.id, "score"), 120, "the point to reach its score")  # mid-point, not at boot
    # the worker's process is the warm start's thin client (a cold fallback would have exec'd prefect.engine)
    assert str(CLIENT) in proc.cmdline(), proc.cmdline()
    [engine] = [p for h in psutil.Process(deployed.warm_server_pid).children() for p in h.children()]
    os.kill(proc.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs([engine], timeout=30)
    assert not alive, "the fork server takes the flow run down with its client"
    done = wait_for(lambda: (r := _read(fr.id)).state.is_final() and r, 120, "the crash to be recorded")
    assert done.state.is_crashed()
    # retired = entered the keep-ring (keep_snapshots=2 keeps it on disk for a rerun)
    wait_for(lambda: (Path(dest) / ".retired").exists(), 60, "the on_crashed hook to retire the snapshot")
    [row] = wait_for(lambda: JsonlSink(point_env.jsonl).read(point_env.run), 30, "the hook's skipped_crashed row")
    assert row.step == 22 and row.metrics["eval/skipped_crashed"] == 1


def _task_started(flow_run_id, prefix: str) -> bool:  # type: ignore[no-untyped-def]
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as c:
        tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
    return any(t.name.startswith(prefix) for t in tasks)


def _log_messages(flow_run_id) -> list[str]:  # type: ignore[no-untyped-def]
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as c:
        logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def _read(flow_run_id):  # type: ignore[no-untyped-def]
    with get_client(sync_client=True) as c:
        return c.read_flow_run(flow_run_id)


