"""An accepted event that never becomes a flow run (its trigger did not fire) is not lost: once
`visible_timeout_s` passes, the client creates the point's run directly, exactly once.

The event goes to a webhook endpoint on loopback that answers 204 and drops it (what a Cloud
webhook whose automation never fires looks like to the trainer); the fallback run is created on
the real deployment and run by the real worker.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pinned_eval.events import BlockNames
from pinned_eval.points import SnapshotSource, SourceKind
from tests.deploykit import Deployed, runs_of_deployment, wait_for
from tests.pointkit import PointEnv, write_step_snapshot
from trainer_integration.client import EvalClient

pytestmark = pytest.mark.e2e


class DroppingWebhook:
    """Accepts every POST with 204 and records the body; nothing ever comes of it."""

    def __init__(self) -> None:
        self.received: list[bytes] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                hook.received.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                self.send_response(204)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/dropped"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_event_without_a_run_falls_back_to_a_direct_run_once(
    point_env: PointEnv, deployed: Deployed, tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trainer_integration")
    dest = str(point_env.staging_root / point_env.run / "step_00000004")
    write_step_snapshot(tiny_model, dest)
    hook = DroppingWebhook()
    try:
        with EvalClient(
            point_env.run, deployed.api_url, blocks=BlockNames(**point_env.blocks), webhook_url=hook.url,
            spool_dir=tmp_path / "spool", visible_timeout_s=3.0, poll_s=0.5,
        ) as client:
            result = client.dispatch(4, source=SnapshotSource(kind=SourceKind.STAGED, path=dest))
            assert result.action == "requested"
            wait_for(lambda: hook.received, 30, "the event's delivery")
            wait_for(lambda: (client.in_flight(), runs_of_deployment(deployed.deployment_id, point_env.run))[1],
                     60, "the fallback run")
            [outcome] = client.drain(timeout=240)
    finally:
        hook.close()
    assert outcome.state == "measured", outcome
    assert len(hook.received) == 1
    runs = runs_of_deployment(deployed.deployment_id, point_env.run)
    assert len(runs) == 1 and runs[0].name == f"{point_env.run}/step-4"
    fallbacks = [r for r in caplog.records if "no flow run from its event" in r.getMessage()]
    assert len(fallbacks) == 1, "the run came from the fallback, once"
