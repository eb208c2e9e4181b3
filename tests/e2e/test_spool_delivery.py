"""The trainer's spool across an orchestrator outage, and a restarted trainer's admission.

A second Prefect server (own home, so its own SQLite DB) gets an eval-point deployment and the
same event trigger as `prefect.yaml`, but no worker: each delivered request shows up as one
Scheduled flow run. The server is stopped mid-run and restarted on the same port and DB; points
requested meanwhile are spooled and delivered after the restart — none lost, none duplicated.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.prefect_server import env_set, start_server, stop_server
from pinned_eval.points import EVENT_REQUESTED, Posture, SnapshotSource
from tests.conftest import free_port
from tests.deploykit import wait_for
from tests.prefect_server import prefect_rest_client
from trainer_integration.client import EvalClient
from trainer_integration.events import event_entry
from trainer_integration.rest import PrefectRest

pytestmark = pytest.mark.e2e


@contextmanager
def prefect_server_at(home: Path, port: int) -> Iterator[str]:
    """`prefect server start` on 127.0.0.1:`port` with `home` (its SQLite DB and API credential,
    sent by clients made in the block); stopped by PID."""
    server = start_server(home, port)
    try:
        with env_set(PREFECT_API_AUTH_STRING=server.auth_string):
            yield server.api_url
    finally:
        stop_server(server.pid)


def _post(c: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST, retrying the 503 a busy SQLite answers right after start."""
    for _ in range(20):
        resp = c.post(path, json=body)
        if resp.status_code != 503:
            return dict(resp.raise_for_status().json())
        time.sleep(0.5)
    raise AssertionError(f"{path}: still 503 after 10 s")


def register_triggered_deployment(api: str) -> str:
    """eval-point/eval-point with the prefect.yaml trigger, created over REST; returns its id."""
    with prefect_rest_client(api, timeout=10) as c:
        flow = _post(c, "/flows/", {"name": "eval-point"})
        dep = _post(c, "/deployments/", {"name": "eval-point", "flow_id": flow["id"]})
        params = {k: f"{{{{ event.payload.{k} }}}}" for k in ("run", "step", "source", "final", "policy")}
        automation = {
            "name": "eval-point-requested",
            "trigger": {
                "type": "event",
                "match": {"prefect.resource.id": "pinned-eval.run.*"},
                "expect": [EVENT_REQUESTED],
                "posture": "Reactive",
                "threshold": 1,
                "within": 0,
            },
            "actions": [
                {"type": "run-deployment", "source": "selected", "deployment_id": dep["id"], "parameters": params}
            ],
        }
        _post(c, "/automations/", automation)
        return str(dep["id"])


def runs_by_step(rest: PrefectRest, run: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in rest.point_runs(run):
        counts[r.step] = counts.get(r.step, 0) + 1
    return counts


def test_outage_spools_and_delivers_each_point_once(tmp_path: Path, tiny_model: Path):
    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    run = "spooltest"
    source = SnapshotSource(kind="hf", path=str(tiny_model), require_marker=False)
    with prefect_server_at(home, port) as api:
        register_triggered_deployment(api)  # runs are created directly on it; the trigger is never needed
        client = EvalClient(run, api, max_in_flight=64, spool_dir=tmp_path / "spool", poll_s=0.2)
        for step in (0, 1, 2):
            assert client.dispatch(step, source=source).action == "requested"
        wait_for(lambda: len(runs_by_step(client.rest, run)) == 3, 60, "the first three runs")
    # the orchestrator is down: the loop goes on, requests go to the spool
    wait_for(lambda: not client.synced, 60, "the admission thread noticing the outage")
    offline = [client.dispatch(step, source=source) for step in (3, 4, 5)]
    assert all(r.action == "requested" and r.admitted_offline for r in offline)
    assert [e.step for e in client.spool.pending()] == [3, 4, 5]
    # the deliverer tried the dead port, failed, and keeps everything
    wait_for(lambda: client.deliverer.last_error is not None, 60, "a failed delivery attempt")
    assert [e.step for e in client.spool.pending()] == [3, 4, 5]
    with prefect_server_at(home, port):
        assert client.deliverer.flush(60), client.deliverer.last_error
        wait_for(lambda: len(runs_by_step(client.rest, run)) == 6, 60, "the spooled runs")
        # a redelivery (a lost 2xx) is the same event id: still one point
        client.spool.append(event_entry(client._request(4, source, False, Posture.FLEET, None), client.blocks))
        client.deliverer.kick()
        assert client.deliverer.flush(30)
        # delivered = the server answered the direct creation (no trigger in the path): the count is final
        assert runs_by_step(client.rest, run) == {s: 1 for s in range(6)}
        # a restarted trainer sees the six Scheduled points as in flight and respects the bound
        client.close()
        restarted = EvalClient(run, api, max_in_flight=6, policy="skip", spool_dir=tmp_path / "spool")
        try:
            assert restarted.in_flight() == set(range(6))
            assert restarted.dispatch(2, source=source).action == "exists"
            busy = restarted.dispatch(6, source=source)
            assert busy.action == "skipped_busy" and busy.in_flight == 6
            outcome = wait_for(
                lambda: next((o for o in restarted.results() if o.step == 6 and o.state != "pending"), None),
                30,
                "the busy skip record",
            )
            assert outcome.state == "skipped" and outcome.reason == "busy" and outcome.flow_runs == 1
        finally:
            restarted.close()
