"""One definition of a run's points in flight, read the same way by the trainer side (REST) and
the Prefect side (history, janitor, operator verbs) — untagged RUNNING runs included.

Real Prefect server (the session fixture); flow runs are created over its REST API in the states
under test (a started run that has not tagged itself yet is untagged and RUNNING).
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from prefect import get_client

from app.history import read_history
from flows.point_runs import point_flow_runs
from pinned_eval.inflight import POINT_FLOW, in_flight
from tests.prefect_server import prefect_rest_client
from trainer_integration.rest import PrefectRest

pytestmark = pytest.mark.e2e


def _flow_run(http: httpx.Client, flow_id: str, run: str, step: int, state: str, tags: list[str]) -> str:
    body = {
        "flow_id": flow_id,
        "name": f"{run}/step-{step}",
        "parameters": {"run": run, "step": step},
        "tags": tags,
        "state": {"type": state, "name": state.title()},
    }
    resp = http.post("/flow_runs/", json=body)
    resp.raise_for_status()
    return str(resp.json()["id"])


def test_untagged_running_run_is_in_flight_for_every_reader(prefect_server: str) -> None:
    run, other = f"r{uuid.uuid4().hex[:8]}", f"o{uuid.uuid4().hex[:8]}"
    with prefect_rest_client(prefect_server) as http:
        flow_id = http.post("/flows/", json={"name": POINT_FLOW}).json()["id"]
        untagged_running = _flow_run(http, flow_id, run, 1, "RUNNING", [])
        tagged_done = _flow_run(http, flow_id, run, 2, "COMPLETED", [f"run:{run}"])
        _flow_run(http, flow_id, run, 3, "COMPLETED", [])  # untagged and terminal: not one of the run's points
        _flow_run(http, flow_id, other, 1, "RUNNING", [])  # another run's point
        scheduled = _flow_run(http, flow_id, run, 4, "SCHEDULED", [])

    with prefect_rest_client() as http:
        rest_runs = PrefectRest(prefect_server, http).point_runs(run)
    with get_client(sync_client=True) as client:
        prefect_runs = point_flow_runs(client, run)

    assert {r.id for r in rest_runs} == {str(r.id) for r in prefect_runs} == {untagged_running, tagged_done, scheduled}
    assert {r.step for r in rest_runs if not r.terminal} == {1, 4}
    states = {int(r.parameters["step"]): r.state.type.value for r in prefect_runs if r.state}
    assert {s for s, t in states.items() if in_flight(t)} == {1, 4}

    history = read_history(run)
    assert [(p.step, p.outcome) for p in history.points] == [(1, "running"), (2, "measured"), (4, "scheduled")]
