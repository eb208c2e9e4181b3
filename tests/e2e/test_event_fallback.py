"""An accepted event that never becomes a flow run (its trigger did not fire) is not lost: once
`visible_timeout_s` passes, the client creates the point's run directly, exactly once."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from pinned_eval.events import BlockNames
from pinned_eval.points import SnapshotSource, SourceKind
from tests.deploykit import Deployed, runs_of_deployment, wait_for
from tests.pointkit import PointEnv, write_step_snapshot
from trainer_integration.client import EvalClient

pytestmark = pytest.mark.e2e


def _set_trigger(api_url: str, deployment_id: str, enabled: bool) -> None:
    with httpx.Client(base_url=api_url, timeout=30) as http:
        automations = http.post("/automations/filter", json={}).json()
        mine = [a for a in automations if a["name"] == "eval-point-requested"]
        assert mine, "the deployment's trigger automation exists"
        for a in mine:
            http.patch(f"/automations/{a['id']}", json={"enabled": enabled}).raise_for_status()


def test_event_without_a_run_falls_back_to_a_direct_run_once(
    point_env: PointEnv, deployed: Deployed, tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trainer_integration.client")
    dest = str(point_env.staging_root / point_env.run / "step_00000004")
    write_step_snapshot(tiny_model, dest)
    _set_trigger(deployed.api_url, deployed.deployment_id, enabled=False)  # the event is accepted, no run
    try:
        with EvalClient(
            point_env.run, deployed.api_url, blocks=BlockNames(**point_env.blocks),
            spool_dir=tmp_path / "spool", visible_timeout_s=3.0, poll_s=0.5,
        ) as client:  # fmt: skip
            result = client.dispatch(4, source=SnapshotSource(kind=SourceKind.STAGED, path=dest))
            assert result.action == "requested"
            wait_for(lambda: not client.spool.pending(), 30, "the event's delivery")
            wait_for(lambda: (client.in_flight(), runs_of_deployment(deployed.deployment_id, point_env.run))[1],
                     60, "the fallback run")  # fmt: skip
            [outcome] = client.drain(timeout=240)
    finally:
        _set_trigger(deployed.api_url, deployed.deployment_id, enabled=True)
    assert outcome.state == "measured", outcome
    runs = runs_of_deployment(deployed.deployment_id, point_env.run)
    assert len(runs) == 1 and runs[0].name == f"{point_env.run}/step-4"
    fallbacks = [r for r in caplog.records if "no flow run from its event" in r.getMessage()]
    assert len(fallbacks) == 1, "the run came from the fallback, once"
