"""Trainer-side pieces without a Prefect server: the spool on a real filesystem, event and skip
record shapes, auth headers and delivery order against a real HTTP server on 127.0.0.1 that
records every request, and the offline path against a closed port."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from pinned_eval.events import BlockNames
from pinned_eval.points import EVENT_REQUESTED, PointRequest, SnapshotSource, point_event_id
from pinned_eval.settings import PrefectApiSettings
from tests.conftest import free_port
from tests.reliability.netfaults import FaultyHTTPProxy, Rule, ScriptedServer
from trainer_integration.admission import AdmissionView
from trainer_integration.client import EvalClient
from trainer_integration.events import Delivery, event_entry, skip_record_entry
from trainer_integration.rest import PointRun, PrefectRest, api_client, auth_headers
from trainer_integration.spool import Deliverer, Spool, SpoolEntry, TransientDeliveryError

SOURCE = SnapshotSource(kind="hf", path="/ckpt/step_7", require_marker=False)


def request(step: int, **kw: Any) -> PointRequest:
    return PointRequest(run="exp42", step=step, source=SOURCE, **kw)


@dataclass
class Recorder:
    """What the local HTTP server saw, and what it answers next (default 204)."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def http_server() -> Iterator[tuple[str, Recorder]]:
    rec = Recorder()

    class Handler(BaseHTTPRequestHandler):
        def _handle(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with rec.lock:
                status = rec.statuses.pop(0) if rec.statuses else 204
                rec.requests.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "headers": dict(self.headers),
                        "json": json.loads(body) if body else None,
                        "status": status,
                    }
                )
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_PATCH = do_GET = _handle

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/api", rec
    finally:
        server.shutdown()
        server.server_close()


# ---- spool -------------------------------------------------------------------------------------


def test_spool_survives_reopen_in_order(tmp_path: Path):
    spool = Spool(tmp_path / "s")
    for step in (3, 1, 2):
        spool.append(event_entry(request(step), BlockNames()))
    reopened = Spool(tmp_path / "s")
    assert [e.step for e in reopened.pending()] == [3, 1, 2]
    assert [e.seq for e in reopened.pending()] == [1, 2, 3]
    nxt = reopened.append(event_entry(request(9), BlockNames()))
    assert nxt.seq == 4  # numbering continues after a restart, so order is kept
    first = reopened.pending()[0]
    reopened.remove(first)
    reopened.reject(reopened.pending()[0], "HTTP 422")
    assert [e.step for e in Spool(tmp_path / "s").pending()] == [2, 9]
    [(rejected, why)] = reopened.rejected()
    assert rejected.step == 1 and why == "HTTP 422"
    assert not list((tmp_path / "s").glob(".tmp-*"))  # no half-written entry left behind


def test_deliverer_keeps_order_across_failures_and_sets_rejects_aside(tmp_path: Path, http_server):
    api, rec = http_server
    # 503 twice (outage), then a 422 for the third entry delivered, the rest succeed
    rec.statuses = [503, 503, 204, 204, 422, 204, 204]
    spool = Spool(tmp_path / "s")
    rest = PrefectRest(api, httpx.Client(timeout=5))
    for step in range(5):
        spool.append(event_entry(request(step), BlockNames()))
    deliverer = Deliverer(spool, Delivery(rest), backoff_s=(0.05, 0.1))
    deliverer.start()
    try:
        assert deliverer.flush(20)
    finally:
        deliverer.stop()
    steps_sent = [r["json"][0]["payload"]["step"] for r in rec.requests]
    # retried in place: 0, 0, 0 (ok), 1 (ok), 2 (422 → set aside), 3, 4 — never reordered
    assert steps_sent == [0, 0, 0, 1, 2, 3, 4]
    assert not spool.pending()
    assert [e.step for e, _ in spool.rejected()] == [2]
    assert all(r["path"] == "/api/events" for r in rec.requests)


# ---- shapes ------------------------------------------------------------------------------------


def test_event_entry_shape():
    req = request(120, final=True, policy="skip", max_in_flight=3, export_time_seconds=1.5)
    entry = event_entry(req, BlockNames(suite="s1", sinks="k1"))
    ev = entry.body
    assert ev["id"] == entry.key == str(point_event_id("exp42", 120))
    assert uuid.UUID(ev["id"]).version == 5
    assert ev["event"] == EVENT_REQUESTED
    assert ev["resource"]["prefect.resource.id"] == "pinned-eval.run.exp42"
    p = ev["payload"]
    assert (p["run"], p["step"], p["final"], p["policy"], p["max_in_flight"]) == ("exp42", 120, True, "skip", 3)
    assert p["source"] == {"kind": "hf", "path": "/ckpt/step_7", "hf_base": None, "require_marker": False}
    assert p["blocks"] == {"suite": "s1", "fleet": "default", "staging": "default", "sinks": "k1"}


def test_skip_record_is_a_named_tagged_completed_skipped_run():
    entry = skip_record_entry(request(8), BlockNames(sinks="k1"), "busy", "step 8: 2 points in flight")
    body = entry.body
    assert body["name"] == "exp42/step-8"
    assert body["tags"] == ["run:exp42", "step:8"]
    assert body["state"] == {"type": "COMPLETED", "name": "Skipped", "message": "busy: step 8: 2 points in flight"}
    assert body["parameters"]["step"] == 8 and body["parameters"]["sinks"] == "k1"
    assert body["idempotency_key"] == entry.key == f"pinned-eval-skip:{point_event_id('exp42', 8)}"


def test_shared_posture_needs_no_source_but_fleet_does():
    assert PointRequest(run="exp42", step=1, posture="shared").source is None
    with pytest.raises(ValueError, match="source"):
        PointRequest(run="exp42", step=1)


# ---- auth --------------------------------------------------------------------------------------


def test_auth_string_wins_over_api_key_on_the_wire(http_server, monkeypatch: pytest.MonkeyPatch):
    api, rec = http_server
    monkeypatch.setenv("PREFECT_API_KEY", "pnu_secret")
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "admin:pass")
    Delivery(PrefectRest(api, api_client(PrefectApiSettings())))(event_entry(request(1), BlockNames()))
    monkeypatch.delenv("PREFECT_API_AUTH_STRING")
    Delivery(PrefectRest(api, api_client(PrefectApiSettings())))(event_entry(request(2), BlockNames()))
    basic, bearer = (r["headers"]["Authorization"] for r in rec.requests)
    assert basic == "Basic " + base64.b64encode(b"admin:pass").decode()
    assert bearer == "Bearer pnu_secret"
    monkeypatch.delenv("PREFECT_API_KEY")
    assert auth_headers(PrefectApiSettings()) == {}


def test_webhook_gets_the_bare_event_with_bearer(http_server, monkeypatch: pytest.MonkeyPatch):
    api, rec = http_server
    monkeypatch.setenv("PREFECT_API_KEY", "pnu_secret")
    for name in ("PREFECT_API_AUTH_STRING", "PINNED_EVAL_API_AUTH_FILE"):  # a basic-auth string would win
        monkeypatch.delenv(name, raising=False)
    hook = api.removesuffix("/api") + "/hooks/abc123"
    delivery = Delivery(PrefectRest(api, api_client(PrefectApiSettings())), webhook_url=hook)
    delivery(event_entry(request(4), BlockNames()))
    [r] = rec.requests
    assert r["path"] == "/hooks/abc123" and r["headers"]["Authorization"] == "Bearer pnu_secret"
    assert r["json"]["event"] == EVENT_REQUESTED and r["json"]["payload"]["step"] == 4  # an object, not a list


# ---- offline -----------------------------------------------------------------------------------


def test_unreachable_api_admits_and_spools_without_raising(tmp_path: Path):
    dead = f"http://127.0.0.1:{free_port()}/api"
    with EvalClient("exp42", dead, spool_dir=tmp_path / "spool", max_in_flight=1, policy="skip") as client:
        results = [client.dispatch(step, source=SOURCE) for step in (1, 2)]
        client.report_progress(2)
        assert [r.action for r in results] == ["requested", "requested"]
        assert all(r.admitted_offline for r in results)
        # the second is admitted although the bound is 1: offline, the flow's own limit decides
        assert results[1].in_flight == 1
        assert client.dispatch(1, source=SOURCE).action == "exists"  # no second request for a step
    pending: list[SpoolEntry] = Spool(tmp_path / "spool" / "exp42").pending()
    assert [e.step for e in pending] == [1, 2]  # kept for the next process to deliver


def test_in_loop_adapter_exports_are_dispatched_as_lora_sources(tmp_path: Path):
    from engine.tiny_model import make_tiny_adapter, make_tiny_model
    from pinned_eval.snapshot.check import check_snapshot
    from pinned_eval.snapshot.lora import write_adapter_snapshot

    base = make_tiny_model(tmp_path / "base")
    adapter = make_tiny_adapter(base, tmp_path / "adapter")
    dead = f"http://127.0.0.1:{free_port()}/api"
    with EvalClient("exp43", dead, spool_dir=tmp_path / "spool", staging_root=tmp_path / "staging",
                    lora_base=base) as client:
        result = client.dispatch(3, export=lambda step, dest: write_adapter_snapshot(adapter, dest))
    assert result.action == "requested"
    [entry] = Spool(tmp_path / "spool" / "exp43").pending()
    source = SnapshotSource.model_validate(entry.body["payload"]["source"])
    assert (source.kind, source.hf_base) == ("lora", str(base))
    assert check_snapshot(source.path).complete  # the staged adapter, marker last


def test_an_exporters_own_error_is_an_export_failed_skip_never_raised(tmp_path: Path):
    """The dispatch contract (README, `trainer_integration.client`): whatever the exporter raises,
    its own bugs included, is this point's `export_failed`; training is never crashed by eval."""
    dead = f"http://127.0.0.1:{free_port()}/api"
    staging = tmp_path / "staging"

    def buggy(step: int, dest: str) -> None:
        Path(dest).mkdir(parents=True)
        (Path(dest) / "model-00001.safetensors").write_bytes(b"partial")
        raise ValueError("exporter bug: shape mismatch")

    with EvalClient("exp42", dead, spool_dir=tmp_path / "spool", staging_root=staging) as client:
        failed = client.dispatch(3, export=buggy)
        ok = client.dispatch(4, export=lambda step, dest: Path(dest).mkdir(parents=True))
    assert failed.action == "skipped_export_failed"
    assert failed.reason == "in-loop export: ValueError('exporter bug: shape mismatch')"
    assert not (staging / "exp42" / "step_00000003").exists()  # the partial output is removed
    assert ok.action == "requested"  # the next point exports again
    entries = Spool(tmp_path / "spool" / "exp42").pending()
    assert [(e.kind, e.step) for e in entries] == [("skip_record", 3), ("event", 4)]
    assert entries[0].body["state"]["message"] == (
        "export_failed: step 3: in-loop export: ValueError('exporter bug: shape mismatch')"
    )


def test_dispatch_raises_only_for_a_misuse_of_the_call_before_any_export(tmp_path: Path):
    dead = f"http://127.0.0.1:{free_port()}/api"
    exported: list[int] = []
    with EvalClient("exp42", dead, spool_dir=tmp_path / "a", staging_root=tmp_path / "staging") as client:
        with pytest.raises(ValueError, match=r"^step: must be >= 0, got -1$"):
            client.dispatch(-1, export=lambda step, dest: exported.append(step))
        with pytest.raises(ValueError, match="source: the 'fleet' posture needs a snapshot source"):
            client.dispatch(1)
    with (
        EvalClient("exp42", dead, spool_dir=tmp_path / "b") as client,
        pytest.raises(ValueError, match=r"^staging_root: an in-loop export needs"),
    ):
        client.dispatch(1, export=lambda step, dest: exported.append(step))
    assert exported == []


def test_trainer_integration_imports_without_prefect():
    code = (
        "import sys, trainer_integration.client, trainer_integration.spool, trainer_integration.events;"
        "bad = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'));"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_s3_staging_credentials_come_from_options_or_the_block_never_raising(tmp_path: Path):
    dead = f"http://127.0.0.1:{free_port()}/api"
    opts = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}
    with EvalClient("exp42", dead, spool_dir=tmp_path / "a", staging_root="s3://bucket/stage",
                    storage_options=opts) as client:
        assert client.storage_options["key"] == "k" and client.storage_options["endpoint_url"] == opts["endpoint_url"]
    exported: list[int] = []
    with EvalClient("exp42", dead, spool_dir=tmp_path / "b", staging_root="s3://bucket/stage") as client:
        # the block cannot be read (API down): that point is export_failed, the loop goes on
        result = client.dispatch(3, export=lambda step, dest: exported.append(step))
    assert result.action == "skipped_export_failed" and exported == []


# ---- admission off the caller's thread ------------------------------------------------------


class ThreadLog:
    """httpx request hook: the thread every HTTP request of a client was made on."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __call__(self, request: httpx.Request) -> None:
        self.threads.append(threading.current_thread().name)

    def client(self) -> httpx.Client:
        return httpx.Client(timeout=5, event_hooks={"request": [self]})


def _point_run(step: int, state: str) -> dict[str, Any]:
    return {
        "id": str(uuid.uuid4()), "name": f"exp42/step-{step}", "parameters": {"run": "exp42", "step": step},
        "state": {"type": state, "name": state.title(), "message": None}, "created": f"2026-01-01T00:00:0{step}Z",
    }


@pytest.fixture
def orchestrator() -> Iterator[tuple[ScriptedServer, list[dict[str, Any]]]]:
    """A scripted API: `/flow_runs/filter` answers the runs in the list it yields; the rest 2xx."""
    runs: list[dict[str, Any]] = []
    ok: Callable[[bytes], tuple[int, dict[str, str], bytes]] = lambda body: (204, {}, b"")  # noqa: E731
    server = ScriptedServer(
        {
            ("POST", "/api/flow_runs/filter"): lambda body: (200, {"Content-Type": "application/json"},
                                                             json.dumps(runs).encode()),
            ("POST", "/api/events"): ok,
            ("PATCH", "/api/variables/name/pinned-eval-progress-exp42"): ok,
        }
    )
    try:
        yield server, runs
    finally:
        server.close()


@pytest.mark.parametrize("api", ["slow", "refusing", "unreachable"])
def test_dispatch_makes_no_network_call_on_the_callers_thread(tmp_path: Path, orchestrator, api: str):
    server, _ = orchestrator
    proxy: FaultyHTTPProxy | None = None
    if api == "unreachable":
        url = f"http://127.0.0.1:{free_port()}/api"
    else:
        rule = Rule("delay", delay_s=0.5) if api == "slow" else Rule("error", status=503)
        proxy = FaultyHTTPProxy(server.url, rules=[rule])
        url = f"{proxy.url}/api"
    hook = ThreadLog()
    try:
        with EvalClient("exp42", url, spool_dir=tmp_path / "spool", max_in_flight=1, policy="skip",
                        http=hook.client(), direct_runs=False) as client:
            results = [client.dispatch(step, source=SOURCE) for step in range(1, 6)]
            client.report_progress(5)
            if api == "slow":  # a slow API still answers: the thread delivers everything in the end
                assert client.deliverer.flush(60), client.deliverer.last_error
    finally:
        if proxy is not None:
            proxy.close()
    assert all(r.action in ("requested", "skipped_busy") for r in results), results
    assert hook.threads, "the background threads talked to the API"
    assert threading.current_thread().name not in hook.threads, hook.threads
    assert set(hook.threads) <= {"pinned-eval-admission", "pinned-eval-progress", "pinned-eval-spool-exp42"}
    if api == "slow":
        assert proxy is not None and proxy.seen("delay", "/api/events")


def test_admission_follows_the_servers_view_after_it_changes(tmp_path: Path, orchestrator):
    server, runs = orchestrator
    runs += [_point_run(1, "RUNNING"), _point_run(2, "SCHEDULED")]  # e.g. a restarted trainer's points
    hook = ThreadLog()
    with EvalClient("exp42", f"{server.url}/api", spool_dir=tmp_path / "spool", max_in_flight=2, policy="skip",
                    http=hook.client(), direct_runs=False, poll_s=0.05, idle_sync_s=0.05) as client:
        assert client.wait_synced(30)
        assert client.dispatch(2, source=SOURCE).action == "exists"
        busy = client.dispatch(3, source=SOURCE)
        assert (busy.action, busy.in_flight, busy.admitted_offline) == ("skipped_busy", 2, False)
        runs[:] = [_point_run(1, "COMPLETED"), _point_run(2, "COMPLETED"), _point_run(3, "COMPLETED")]
        seen_before = server.requests.count(("POST", "/api/flow_runs/filter"))
        while server.requests.count(("POST", "/api/flow_runs/filter")) < seen_before + 2:
            client.wait_synced(1)  # two fresh reads after the change: one began after it
            time.sleep(0.02)
        ok = client.dispatch(4, source=SOURCE)
        assert (ok.action, ok.in_flight, ok.admitted_offline) == ("requested", 0, False)
    assert threading.current_thread().name not in hook.threads


@pytest.mark.parametrize("max_in_flight", [1, 2, 3])
def test_skip_policy_admits_up_to_exactly_the_bound(max_in_flight: int) -> None:
    """`max_in_flight - 1` others in flight: admitted; `max_in_flight`: busy (never one slot early
    or late)."""
    view = AdmissionView("exp42", visible_timeout_s=60)

    def decide(step: int, others: int, *, final: bool = False) -> tuple[str, int]:
        runs = [PointRun(id=str(s), name=f"exp42/step-{s}", step=s, state_type="RUNNING", state_name="Running",
                         message=None, created="2026-01-01T00:00:00Z") for s in range(100, 100 + others)]
        view.refresh(runs, set())
        verdict, n, _, offline = view.decide(step, final=final, policy="skip", max_in_flight=max_in_flight,
                                             spooled=set, poll_s=0.01, wake=lambda: None)
        assert not offline
        return verdict, n

    assert decide(1, max_in_flight - 1) == ("ok", max_in_flight - 1)
    assert decide(2, max_in_flight) == ("busy", max_in_flight)
    assert decide(3, max_in_flight + 1) == ("busy", max_in_flight + 1)
    assert decide(4, 0) == ("ok", 0)


# ---- direct runs, the event as fallback ----------------------------------------------------------


@pytest.mark.parametrize("server_says", ["created", "no deployment", "busy"])
def test_a_point_is_created_directly_and_the_event_is_sent_only_when_that_is_refused(server_says: str):
    bodies: list[dict[str, Any]] = []

    def create(body: bytes) -> tuple[int, dict[str, str], bytes]:
        bodies.append(json.loads(body))
        return (201, {"Content-Type": "application/json"}, b"{}") if server_says == "created" else (503, {}, b"")

    dep = (200, {"Content-Type": "application/json"}, b'{"id": "dep1"}') if server_says != "no deployment" else (
        404, {}, b'{"detail": "Deployment not found"}')
    server = ScriptedServer({
        ("GET", "/api/deployments/name/eval-point/eval-point"): lambda body: dep,
        ("POST", "/api/deployments/dep1/create_flow_run"): create,
        ("POST", "/api/events"): lambda body: (204, {}, b""),
    })
    entry = event_entry(request(7, final=True), BlockNames(sinks="k1"))
    try:
        delivery = Delivery(PrefectRest(f"{server.url}/api", httpx.Client(timeout=5)), direct_runs=True)
        if server_says == "busy":  # transient: the same direct request is retried later, no event
            with pytest.raises(TransientDeliveryError):
                delivery(entry)
        else:
            delivery(entry)
    finally:
        server.close()
    events = [r for r in server.requests if r == ("POST", "/api/events")]
    if server_says == "no deployment":
        assert len(events) == 1 and not bodies
        return
    assert not events
    body = bodies[0]
    assert body["idempotency_key"] == entry.key == str(point_event_id("exp42", 7))
    assert (body["name"], body["tags"]) == ("exp42/step-7", ["run:exp42", "step:7"])
    params = body["parameters"]
    assert (params["run"], params["step"], params["final"], params["sinks"], params["suite"]) == (
        "exp42", 7, True, "k1", "default")
    assert "blocks" not in params and params["source"]["path"] == "/ckpt/step_7"


def test_backpressure_waits_for_the_admission_thread_to_see_a_slot_free(tmp_path: Path, orchestrator):
    server, runs = orchestrator
    runs += [_point_run(1, "RUNNING"), _point_run(2, "RUNNING")]
    hook = ThreadLog()
    out: list[Any] = []
    with EvalClient("exp42", f"{server.url}/api", spool_dir=tmp_path / "spool", max_in_flight=2,
                    policy="backpressure", http=hook.client(), direct_runs=False, poll_s=0.05) as client:
        assert client.wait_synced(30)
        trainer = threading.Thread(target=lambda: out.append(client.dispatch(3, source=SOURCE)), name="trainer")
        trainer.start()
        queried = server.requests.count(("POST", "/api/flow_runs/filter"))
        while server.requests.count(("POST", "/api/flow_runs/filter")) < queried + 3:
            time.sleep(0.02)  # the admission thread keeps re-reading while the trainer waits
        assert not out, "dispatched although both slots were busy"
        runs[1] = _point_run(2, "COMPLETED")
        trainer.join(60)
    [result] = out
    assert (result.action, result.in_flight, result.admitted_offline) == ("requested", 1, False)
    assert result.waited_seconds > 0
    assert "trainer" not in hook.threads
