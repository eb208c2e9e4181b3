"""Signals of the eval-point flow, through the real flow, server and CPU fleet: per-dataset cadence,
outcome events, and a regression reaching a local HTTP receiver through a real automation."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prefect import get_client
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
from typer.testing import CliRunner

from app.automations import ALERT_EVENTS, AUTOMATION_PREFIX, ensure_alerts_in
from app.cli import app as cli_app
from blocks import EvalSuiteBlock, FleetBlock
from flows.eval_point import eval_point
from pinned_eval.events import EVENT_MEASURED, EVENT_SKIPPED, BlockNames, point_resource, post_events
from pinned_eval.polling import poll_until
from pinned_eval.sinks import JsonlSink, MetricRow
from pinned_eval.suite import DatasetSpec
from tests.pointkit import SMALL_SUITE, CpuFleet, PointEnv, save_point_blocks
from tests.prefect_server import prefect_rest_client
from trainer_integration import EvalClient

pytestmark = pytest.mark.e2e


def _env(tmp_path: Path, cpu_fleet: CpuFleet, **kw: object) -> PointEnv:
    fleet = FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))
    return save_point_blocks(tmp_path, fleet, **kw)  # type: ignore[arg-type]


def _hf(tiny_model: Path) -> dict[str, object]:
    return {"kind": "hf", "path": str(tiny_model), "require_marker": False}


def test_cadence_runs_the_due_datasets_and_the_final_point_all(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path
) -> None:
    add, sub = SMALL_SUITE.datasets
    suite = SMALL_SUITE.model_copy(update={"datasets": (add, sub.model_copy(update={"every_n_steps": 200}))})
    env = _env(tmp_path, cpu_fleet, suite=suite)
    state = eval_point(**env.params(100, source=_hf(tiny_model)), return_state=True)
    assert state.name == "Completed" and state.message.endswith("(not due: arith_sub)"), state.message
    final = eval_point(**env.params(150, source=_hf(tiny_model), final=True), return_state=True)
    assert final.name == "Completed" and "not due" not in final.message, final.message
    rows = {(r.step, r.dataset): r.metrics for r in JsonlSink(env.jsonl).read(env.run)}
    assert sorted(rows) == [(100, "arith_add"), (150, "arith_add"), (150, "arith_sub")]
    assert (rows[100, "arith_add"]["eval/datasets_run"], rows[100, "arith_add"]["eval/datasets_not_due"]) == (1, 1)
    assert (rows[150, "arith_sub"]["eval/datasets_run"], rows[150, "arith_sub"]["eval/datasets_not_due"]) == (2, 0)

    # the best checkpoint, back to the trainer and the operator: the same weights score the same at
    # 100 and 150, so arith_add ties (earliest wins); arith_sub ran only at the final point
    with EvalClient(env.run, prefect_server, blocks=BlockNames(**env.blocks), spool_dir=tmp_path / "spool") as client:
        add_best, sub_best = client.best("eval/arith_add"), client.best("eval/arith_sub")
        assert client.best("eval/nonexistent") is None
    assert add_best is not None and sub_best is not None
    assert (add_best.step, sub_best.step) == (100, 150)
    assert sub_best.metrics["arith_sub"]["eval/arith_sub"] == rows[150, "arith_sub"]["eval/arith_sub"]
    out = CliRunner().invoke(cli_app, ["best", env.run, "--metric", "eval/arith_sub", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {"run": env.run, "step": 150, "metric": "eval/arith_sub",
                                      "value": rows[150, "arith_sub"]["eval/arith_sub"], "weight_version": "150",
                                      "flow_run_id": str(final.state_details.flow_run_id)}
    missing = CliRunner().invoke(cli_app, ["best", env.run, "--metric", "eval/nonexistent"])
    assert missing.exit_code == 1 and "no measured point" in missing.output


def test_no_dataset_due_is_a_skipped_point(prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path) -> None:
    rare = DatasetSpec(name="rare", path="builtin:arith_add.jsonl", every_n_steps=500, max_prompts=2)
    env = _env(tmp_path, cpu_fleet, suite=SMALL_SUITE.model_copy(update={"datasets": (rare,)}))
    source = {"kind": "hf", "path": str(tmp_path / "never-read")}
    state = eval_point(**env.params(100, source=source), return_state=True)
    assert state.name == "Skipped" and state.message == "no_dataset_due: step 100: no dataset is due (every_n_steps)"
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert (row.state, row.reason) == ("skipped", "no_dataset_due")


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[dict[str, str]]

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", 0))
        self.server.bodies.append(json.loads(self.rfile.read(length)))  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[dict[str, str]]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.bodies = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", server.bodies  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def alert_automations(prefect_server: str, receiver: tuple[str, list[dict[str, str]]]) -> Iterator[str]:
    """The deploy-time automations, notifying `receiver` through a saved custom-webhook block;
    without the block, none is created."""
    url, bodies = receiver
    block = f"alerts-{uuid.uuid4().hex[:8]}"
    assert ensure_alerts_in(dict(os.environ), block) == f"alerts off: no notification block named {block!r} " \
        "(save one, then deploy again)"
    CustomWebhookNotificationBlock(
        name=block, url=url, allow_private_urls=True, json_data={"subject": "{{subject}}", "body": "{{body}}"}
    ).save(block)
    # what `pinned-eval deploy` runs, with this process's environment (the session server's API)
    assert ensure_alerts_in(dict(os.environ), block) == f"alerts: 3 automations notify through block {block!r}"
    with get_client(sync_client=True) as client:
        ids = [a.id for kind in ALERT_EVENTS for a in client.read_automations_by_name(f"{AUTOMATION_PREFIX}{kind}")]
    assert len(ids) == len(ALERT_EVENTS)
    # the trigger service loads new automations on its own schedule: a canary skip, sent again
    # until its notification arrives, proves they are live
    canary = f"canary{uuid.uuid4().hex[:6]}"

    def live() -> bool:
        event = {"id": str(uuid.uuid4()), "occurred": datetime.now(UTC).isoformat(), "event": EVENT_SKIPPED,
                 "resource": point_resource(canary, 1), "payload": {"reason": "canary"}}
        with prefect_rest_client(timeout=10) as http:
            post_events(prefect_server, [event], client=http)
        return any(canary in b["subject"] for b in bodies)

    poll_until(live, timeout_s=90, interval_s=3, what="the alert automations to notify a canary skip")
    try:
        yield block
    finally:
        with get_client(sync_client=True) as client:
            for automation_id in ids:
                client.delete_automation(automation_id)


def _events(name: str, resource_prefix: str) -> list[dict[str, object]]:
    with get_client(sync_client=True) as client:
        page = client.read_events(
            EventFilter(
                occurred=EventOccurredFilter.model_validate({"since": datetime(2020, 1, 1, tzinfo=UTC)}),
                event=EventNameFilter(name=[name]),
                resource=EventResourceFilter(id_prefix=[resource_prefix]),
            ),
            limit=50,
        )
    return [e.model_dump(mode="json") for e in page.events]


@pytest.mark.timeout(480)  # a cold session server and fleet, plus the trigger service's first load
def test_regression_skip_and_failure_reach_a_webhook_through_real_automations(
    prefect_server: str,
    cpu_fleet: CpuFleet,
    tmp_path: Path,
    tiny_model: Path,
    receiver: tuple[str, list[dict[str, str]]],
    alert_automations: str,
) -> None:
    _, bodies = receiver
    env = _env(tmp_path, cpu_fleet)
    EvalSuiteBlock(suite=SMALL_SUITE, regression={"baseline": "best"}).save(env.blocks["suite"], overwrite=True)
    # the run's best so far, as the JSONL record of an earlier measured point holds it
    JsonlSink(env.jsonl).write_point(
        [MetricRow(run=env.run, step=10, dataset="arith_add", state="measured", metrics={"eval/arith_add": 1.0})]
    )
    state = eval_point(**env.params(20, source=_hf(tiny_model)), return_state=True)
    assert state.name == "Completed" and "regressed: arith_add" in state.message, state.message
    [row] = [r for r in JsonlSink(env.jsonl).read(env.run) if r.step == 20 and r.dataset == "arith_add"]

    skipped = eval_point(**env.params(30, source={"kind": "hf", "path": str(tmp_path / "missing")}), return_state=True)
    assert skipped.name == "Skipped", skipped.message
    failed = eval_point(**env.params(40, source={"kind": "hf", "path": "/outside/the/roots"}), return_state=True)
    assert failed.is_failed()

    def notified() -> dict[str, dict[str, str]] | None:
        seen = {kind: b for b in bodies for kind in ALERT_EVENTS if b["subject"].startswith(
            f"pinned-eval: {env.run}/step-") and b["subject"].endswith(kind)}
        return seen if len(seen) == len(ALERT_EVENTS) else None

    seen = poll_until(notified, timeout_s=90, interval_s=0.5, what="failed, skipped and regressed notifications")
    assert seen["regressed"]["subject"] == f"pinned-eval: {env.run}/step-20/arith_add regressed"
    payload = json.loads(seen["regressed"]["body"].splitlines()[-1])
    assert payload == {"dataset": "arith_add", "metric": "eval/arith_add", "value": row.metrics["eval/arith_add"],
                       "baseline": 1.0, "baseline_step": 10, "drop": 1.0 - row.metrics["eval/arith_add"],
                       "ci95_high": row.metrics["eval/arith_add/ci95_high"]}
    assert seen["skipped"]["subject"] == f"pinned-eval: {env.run}/step-30 skipped"
    assert seen["failed"]["subject"] == f"pinned-eval: {env.run}/step-40 failed"
    assert f"run {env.run}, step 40, dataset -" in seen["failed"]["body"]
    measured = _events(EVENT_MEASURED, f"pinned-eval.point.{env.run}.20")
    assert sorted(e["resource"]["pinned-eval.dataset"] for e in measured) == ["arith_add", "arith_sub"]  # type: ignore[index]
