"""The janitor's share of a point's signals, on the real Prefect server (no fleet: the flow runs are
created over the API in the states under test, as a dead worker or host leaves them):

- a crashed point is alerted once: `pinned-eval.point.failed` from whichever of the janitor or the
  `on_crashed` hook ends the run, never from both, nor from two janitor passes that both read it
  Running (the second's Crashed transition is refused);
- an alert emitted outside any run relates the point's flow run only, never the flow run the
  process's events worker was started in (`tasks.alerts`);
- every janitor retire keeps the staging block's best-K steps (keep_best) and trims the ring.
The same alert from a really SIGKILLed point the janitor crashes:
tests/e2e/test_operator_cli.py::test_janitor_crashes_a_point_whose_host_is_gone; from the hook of a
really stopped worker: tests/e2e/test_worker_stop.py (the point in flight).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.context import FlowRunContext
from prefect.events import emit_event
from prefect.events.worker import EventsWorker
from prefect.states import Completed, Crashed, Running

from blocks import FleetBlock, StagingBlock
from flows.eval_point import eval_point, retire_on_crash
from flows.janitor import StuckPoint, crash_point, janitor
from pinned_eval.events import EVENT_FAILED, point_resource
from pinned_eval.sinks import JsonlSink, MetricRow
from tasks.alerts import emit_failed
from tests.eventkit import related_flow_runs, settled_events
from tests.pointkit import PointEnv, save_point_blocks, write_step_snapshot

pytestmark = pytest.mark.e2e
METRIC = "eval/arith_add"


@pytest.fixture
def best_env(prefect_server: str, tmp_path: Path) -> PointEnv:
    """Blocks of a run whose staging keeps a ring of 1 and its best step by METRIC; no fleet."""
    dead = FleetBlock(name=f"d{uuid.uuid4().hex[:6]}", mode="attach", engine_urls=["http://127.0.0.1:9"],
                      router_url="http://127.0.0.1:9")
    env = save_point_blocks(tmp_path, dead, keep_snapshots=1)
    block = StagingBlock.load(env.blocks["staging"])
    block.keep_best, block.keep_best_metric = 1, METRIC
    block.save(env.blocks["staging"], overwrite=True)
    JsonlSink(env.jsonl).write_point([MetricRow(run=env.run, step=s, dataset="arith_add", state="measured",
                                                metrics={METRIC: v}) for s, v in ((1, 0.9), (2, 0.5), (3, 0.1))])
    return env


def _flow_run(env: PointEnv, step: int, state: object, **params: object) -> str:
    with get_client(sync_client=True) as c:
        fr = c.create_flow_run(eval_point, parameters=env.params(step, **params), name=f"{env.run}/step-{step}",
                               tags=[f"run:{env.run}", f"step:{step}"], state=state)  # type: ignore[arg-type]
    return str(fr.id)


def _left(env: PointEnv) -> list[int]:
    return sorted(s.step for s in StagingBlock.load(env.blocks["staging"]).staging().list(env.run))


def test_janitor_retires_keep_the_best_step_and_trim_the_ring(best_env: PointEnv, tiny_model: Path) -> None:
    env = best_env
    block = StagingBlock.load(env.blocks["staging"])
    store = block.staging()
    paths = {s: write_step_snapshot(tiny_model, store.path_for(env.run, s)) for s in (1, 2, 3, 5)}
    for step in (1, 2):  # as their points retired them: ring [2], best [1]
        store.retire(paths[step], owned=True, protect=block.protected_steps(env.run, str(env.jsonl)))
    assert _left(env) == [1, 2, 3, 5]

    # the sweep: step 3's point ended without retiring (its hook was lost)
    _flow_run(env, 3, Completed(), source={"kind": "staged", "path": paths[3]})
    report = janitor(heartbeat_window_s=600, run=env.run, staging=[env.blocks["staging"]])
    assert report.retired == [paths[3]]
    assert _left(env) == [1, 3, 5]  # ring [3], best [1]: step 2 deleted, step 1 kept

    # a crash: step 5's point is a zombie
    fr = _flow_run(env, 5, Running(), source={"kind": "staged", "path": paths[5]})
    stuck = StuckPoint(flow_run_id=fr, name=f"{env.run}/step-5", run=env.run, step=5, state="Running",
                       last_activity=datetime.now(UTC), quiet_seconds=700.0)
    assert crash_point(stuck, 600.0) == [paths[5]]
    assert _left(env) == [1, 5]  # ring [5], best [1]


def test_a_crashed_point_is_alerted_once_whoever_ends_it(best_env: PointEnv) -> None:
    env = best_env
    # two janitor passes both read step 5 Running; the second's Crashed transition is refused
    fr5 = _flow_run(env, 5, Running())
    stuck = StuckPoint(flow_run_id=fr5, name=f"{env.run}/step-5", run=env.run, step=5, state="Running",
                       last_activity=datetime.now(UTC), quiet_seconds=700.0)
    assert crash_point(stuck, 600.0) == []  # crashed (no snapshot to retire)
    assert crash_point(stuck, 600.0) is None  # the run ended meanwhile: nothing done
    # step 6 ended by the worker: it proposes Crashed, then runs the hook; a janitor pass follows
    fr6 = _flow_run(env, 6, Running())
    with get_client(sync_client=True) as c:
        c.set_flow_run_state(fr6, Crashed(message="Process exited with status code: -9."))
        run6 = c.read_flow_run(uuid.UUID(fr6))
    assert run6.state is not None
    retire_on_crash(eval_point, run6, run6.state)
    assert janitor(heartbeat_window_s=0.001, run=env.run, staging=[env.blocks["staging"]]).crashed == []

    [janitor_event] = settled_events(EVENT_FAILED, point_resource(env.run, 5)["prefect.resource.id"])
    [hook_event] = settled_events(EVENT_FAILED, point_resource(env.run, 6)["prefect.resource.id"])
    assert related_flow_runs(janitor_event) == [f"prefect.flow-run.{fr5}"]
    assert janitor_event["payload"]["reason"] == "crashed"
    assert janitor_event["payload"]["error"].startswith("janitor: no activity for 700s (window 600s")
    assert f"prefect.flow-run.{fr6}" in related_flow_runs(hook_event)
    assert hook_event["payload"] == {"reason": "crashed", "error": "Process exited with status code: -9."}
    crashed = [(r.step, r.reason) for r in JsonlSink(env.jsonl).read(env.run) if r.state == "failed"]
    assert crashed == [(5, "crashed"), (6, "crashed")]


@flow(name="events-worker-starter")
def _start_events_worker() -> str:
    """Emit an event inside this flow run (the process's events worker starts here) and return its id."""
    emit_event("pinned-eval.test.starter", resource={"prefect.resource.id": f"pinned-eval.test.{uuid.uuid4().hex}"})
    ctx = FlowRunContext.get()
    assert ctx is not None and ctx.flow_run is not None
    return str(ctx.flow_run.id)


def test_an_alert_outside_any_run_relates_the_point_only(prefect_server: str) -> None:
    # the events worker keeps the run context it was started in; an emitter outside any run (the
    # hook, a crash outside the janitor flow) sets no run context of its own
    EventsWorker.drain_all(timeout=30)
    starter = _start_events_worker()
    point, run = str(uuid.uuid4()), f"t{uuid.uuid4().hex[:8]}"
    emit_failed(run, 7, "Process exited with status code: -9.", flow_run_id=point)
    [event] = settled_events(EVENT_FAILED, point_resource(run, 7)["prefect.resource.id"])
    assert related_flow_runs(event) == [f"prefect.flow-run.{point}"]
    assert f"prefect.flow-run.{starter}" not in [r["prefect.resource.id"] for r in event["related"]]
