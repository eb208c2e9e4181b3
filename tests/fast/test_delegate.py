"""miles' `eval.delegate` (`pinned_eval.delegate`): the config as miles reads it, the request body
byte for byte as miles' own client posts it (golden), the reply's metrics as miles names them, and
a hostile delegate over real HTTP on loopback (error status, garbage, hang, redirect, flood,
compression) against a point gateway in front of a recording fake fleet."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pinned_eval.delegate import client as delegate_client
from pinned_eval.delegate.client import MAX_KEY, DelegateFailed, flatten, post
from pinned_eval.delegate.config import DelegateSpec, parse_delegates, request_body
from pinned_eval.delegate.run import DelegateRun
from pinned_eval.fleet.errors import WeightVersionMismatch
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.gateway import GatewayLimits
from pinned_eval.rollout.session import PointSession
from pinned_eval.skips import EvalSkipped
from pinned_eval.suite import EvalSuite, SamplingFallbacks
from tests.fast.test_gateway import FLEET_KEY, FakeFleet, fleet, http  # noqa: F401 - fixtures

DATA = Path(__file__).parent.parent / "data"
CONFIGS = Path(__file__).parent.parent / "miles_configs"
GOLDEN = json.loads((DATA / "miles_delegate_golden.json").read_text())


def test_request_body_is_byte_for_byte_miles_own() -> None:
    suite = EvalSuite.from_miles_yaml(CONFIGS / "delegate_golden.yaml", check_imports=False)
    [spec] = suite.delegates
    assert spec.url == "http://127.0.0.1:9050/evaluate"  # miles strips the trailing '/'
    assert GOLDEN["request_path"] == "/evaluate"
    body = request_body(spec, suite.fallbacks, GOLDEN["rollout_id"], GOLDEN["router_url"])
    assert body == GOLDEN["request_body"].encode()
    # eval.defaults (temperature 0.6) is not applied to delegate datasets, as in miles
    assert [b["temperature"] for b in json.loads(body)["benchmarks"]] == [1.0, 0.0, 0.25]
    # the suite block stores it as JSON: the same request after the round trip
    again = EvalSuite.model_validate_json(suite.model_dump_json())
    assert request_body(again.delegates[0], again.fallbacks, GOLDEN["rollout_id"], GOLDEN["router_url"]) == body


def test_a_field_set_to_null_is_left_out_as_in_miles() -> None:
    entry = _entry(defaults={"top_k": None}, datasets=[{"name": "a", "top_p": None}])
    [spec] = parse_delegates("eval.delegate", [entry])
    again = DelegateSpec.model_validate_json(spec.model_dump_json())
    assert json.loads(request_body(again, SamplingFallbacks(), 1, "http://r"))["benchmarks"] == [
        {"name": "a", "n_samples_per_eval_prompt": 1, "temperature": 1.0, "max_response_len": 1024}]


def test_reply_metrics_are_named_as_miles_names_them() -> None:
    assert flatten(GOLDEN["reply"]["raw_metrics"]) == GOLDEN["metrics"]


def test_non_finite_and_huge_numbers_are_dropped_and_floods_refused() -> None:
    assert flatten({"a": {"x": float("nan"), "y": float("inf"), "z": 10**400, "w": 2}}) == {"eval/a/w": 2.0}
    with pytest.raises(ValueError, match="over 4096 metrics"):
        flatten({f"m{i}": i for i in range(4097)})
    with pytest.raises(ValueError, match=f"metric key over {MAX_KEY} characters"):
        flatten({"k" * 600: 1})


def _entry(**over: Any) -> dict[str, Any]:
    return {"name": "skills", "url": "http://127.0.0.1:1/evaluate", "datasets": [{"name": "aime25"}], **over}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"url": "http://x"}, r"^eval\.delegate: must be a list"),
        (["skills"], r"^eval\.delegate\[0\]: must be a mapping"),
        ([_entry(bogus=1)], r"^eval\.delegate\[0\]\.bogus: not supported"),
        ([_entry(url=None)], r"^eval\.delegate\[0\]\.url: required"),
        ([_entry(url="file:///etc/passwd")], r"^eval\.delegate\[0\]\.url: .*http\(s\) URL"),
        ([_entry(url="ftp://h/x")], r"^eval\.delegate\[0\]\.url: .*http\(s\) URL"),
        ([_entry(datasets=[])], r"^eval\.delegate\[0\]\.datasets: required"),
        ([_entry(datasets=["aime25"])], r"^eval\.delegate\[0\]\.datasets\[0\]: must be a mapping"),
        ([_entry(datasets=[{"name": "aime25:4"}])], r"^eval\.delegate\[0\]\.datasets\[0\]\.name: .*':' is not"),
        ([_entry(datasets=[{"name": " "}])], r"^eval\.delegate\[0\]\.datasets\[0\]\.name: String should have"),
        ([_entry(datasets=[{"name": "a", "path": "/x"}])], r"^eval\.delegate\[0\]\.datasets\[0\]\.path: not"),
        ([_entry(datasets=[{"name": "a", "top_p": 2}])], r"^eval\.delegate\[0\]\.datasets\[0\]\.top_p: Input"),
        ([_entry(headers={"X-N": 1})], r"^eval\.delegate\[0\]\.headers\.X-N: Input should be a valid string"),
        ([_entry(defaults={"rm_type": "math"})], r"^eval\.delegate\[0\]\.defaults\.rm_type: not supported"),
        ([_entry(timeout_secs=0)], r"^eval\.delegate\[0\]\.timeout_secs: Input should be greater than 0"),
        ([_entry(), _entry()], r"^eval\.delegate\[1\]\.name: 'skills' names two delegates"),
    ],
)
def test_bad_delegate_entries_are_refused_naming_the_key(raw: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_delegates("eval.delegate", raw)


def test_strict_miles_accepts_only_the_delegate_miles_registers() -> None:
    assert parse_delegates("eval.delegate", [_entry()], strict_miles=True)[0].name == "skills"
    with pytest.raises(ValueError, match=r"^eval\.delegate\[0\]\.name: miles registers only the delegate 'skills'"):
        parse_delegates("eval.delegate", [_entry(name="mine")], strict_miles=True)


# -- a delegate over real HTTP ------------------------------------------------------------------
class FakeDelegate:
    """Speaks miles' protocol on /evaluate (one chat call per benchmark through `router_url`, key
    EMPTY as NeMo-Skills sends it); the other paths misbehave."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.release = asyncio.Event()
        self.redirected = 0
        paths = ["/evaluate", "/error", "/garbage", "/hang", "/redirect", "/sink", "/flood", "/gzip", "/list",
                 "/nometrics", "/strings", "/second"]
        self.app = Starlette(routes=[Route(p, self.handle, methods=["POST"]) for p in paths])

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        path = request.url.path
        if path == "/evaluate":
            job = json.loads(body)
            scores = {}
            async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
                for bench in job["benchmarks"]:
                    r = await http.post(f"{job['router_url']}/v1/chat/completions",
                                        headers={"Authorization": "Bearer EMPTY"},
                                        json={"model": "miles-openai-model", "messages": [{"role": "user",
                                                                                           "content": "hi"}]})
                    scores[bench["name"]] = {"status": r.status_code, "ok": r.status_code == 200, "note": "x"}
            return JSONResponse({"job_id": "1", "raw_metrics": scores})
        if path == "/error":
            return Response("overloaded", status_code=503)
        if path == "/garbage":
            return Response("<html>not json", media_type="text/html")
        if path == "/hang":
            await self.release.wait()
            return JSONResponse({"raw_metrics": {"late": 1}})
        if path == "/redirect":
            return Response(status_code=307, headers={"Location": "/sink"})
        if path == "/sink":
            self.redirected += 1
            return JSONResponse({"raw_metrics": {"stolen": 1}})
        if path == "/flood":
            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(64):
                    yield b" " * 1024
            return StreamingResponse(chunks(), media_type="application/json")
        if path == "/gzip":
            return Response(b"\x1f\x8b", headers={"Content-Encoding": "gzip"})
        if path == "/list":
            return JSONResponse([1, 2])
        if path == "/second":
            return JSONResponse({"raw_metrics": {"aime25": {"other": 1}}})
        if path == "/nometrics":
            return JSONResponse({"job_id": "1"})
        return JSONResponse({"raw_metrics": {"a": "text only"}})


@pytest.fixture
async def delegate_url() -> AsyncIterator[tuple[FakeDelegate, str]]:
    fake = FakeDelegate()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake.app, lifespan="off", log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # uvicorn offers no event; its own flag, polled
        await asyncio.sleep(0.01)
    try:
        yield fake, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        fake.release.set()
        server.should_exit = True
        await task
        sock.close()


def _spec(url: str, path: str, **over: Any) -> DelegateSpec:
    [spec] = parse_delegates("eval.delegate", [{"name": "nemo", "url": f"{url}{path}", "timeout_secs": 5,
                                                "datasets": [{"name": "aime25"}, {"name": "hle"}], **over}])
    return spec


def _run(url: str, client: httpx.AsyncClient, *specs: DelegateSpec, prior: int = 0, **limits: Any) -> DelegateRun:
    session = PointSession(RouterGenerator(client, url, api_key=FLEET_KEY), expected_version="7", rid_prefix="p")
    return DelegateRun(session, specs, SamplingFallbacks(), 7, GatewayLimits(**limits), prior_requests=prior)


async def test_delegate_calls_go_through_the_gateway_at_the_pinned_version(
    fleet: tuple[FakeFleet, str], http: httpx.AsyncClient, delegate_url: tuple[FakeDelegate, str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_fleet, fleet_url = fleet
    fake, url = delegate_url
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):  # never used for a delegate
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")
    job = _run(fleet_url, http, _spec(url, "/evaluate", headers={"X-Team": "evals"}))
    metrics = await job.run()
    assert metrics == {"eval/aime25/status": 200.0, "eval/aime25/ok": 1.0, "eval/hle/status": 200.0,
                       "eval/hle/ok": 1.0}
    sent = json.loads(fake.bodies[0])
    assert sent["rollout_id"] == 7 and sent["router_url"].startswith("http://127.0.0.1:")
    assert sent["router_url"].count("/t/") == 1  # the gateway's token rides in the URL miles passes
    assert fake.headers[0]["x-team"] == "evals" and fake.headers[0]["content-type"] == "application/json"
    assert [(c["delegate"], c["route"], c["status"], c["weight_version"]) for c in job.calls] == [
        ("nemo", "/v1/chat/completions", 200, "7")] * 2
    assert [h["authorization"] for _, h, _ in fake_fleet.seen] == [f"Bearer {FLEET_KEY}"] * 2  # EMPTY replaced
    assert job.replies["nemo"]["job_id"] == "1"
    # the gateway is gone once the delegate answered: its URL leads nowhere
    with pytest.raises(httpx.ConnectError):
        await http.post(f"{sent['router_url']}/v1/chat/completions", json={"messages": []})


async def test_a_wrong_token_in_the_url_is_refused(
    fleet: tuple[FakeFleet, str], http: httpx.AsyncClient  # noqa: F811
) -> None:
    from pinned_eval.delegate.gateway import UrlTokenGateway

    _, fleet_url = fleet
    session = PointSession(RouterGenerator(http, fleet_url, api_key=FLEET_KEY), expected_version="7", rid_prefix="p")
    async with UrlTokenGateway(session, GatewayLimits()) as gw:
        wrong = await http.post(f"{gw.base_url}/t/guess/v1/completions", json={"model": "m", "prompt": "x"})
        assert wrong.status_code == 401
        right = await http.post(f"{gw.router_url}/v1/completions", json={"model": "m", "prompt": "x"})
        assert right.status_code == 200 and right.json()["choices"][0]["text"] == "done"
        models = await http.get(f"{gw.router_url}/v1/models", headers={"Authorization": "Bearer EMPTY"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"


async def test_a_later_delegates_top_level_key_replaces_an_earlier_ones_as_in_miles(
    fleet: tuple[FakeFleet, str], http: httpx.AsyncClient, delegate_url: tuple[FakeDelegate, str]  # noqa: F811
) -> None:
    _, url = delegate_url
    first = _spec(url, "/evaluate")
    [second] = parse_delegates("eval.delegate", [{"name": "other", "url": f"{url}/second",
                                                  "datasets": [{"name": "aime25"}]}])
    metrics = await _run(fleet[1], http, first, second).run()
    assert metrics == {"eval/aime25/other": 1.0, "eval/hle/status": 200.0, "eval/hle/ok": 1.0}


async def test_another_weight_version_behind_the_delegate_is_pin_violation(
    fleet: tuple[FakeFleet, str], http: httpx.AsyncClient, delegate_url: tuple[FakeDelegate, str]  # noqa: F811
) -> None:
    fake_fleet, fleet_url = fleet
    fake_fleet.version = "8"
    _, url = delegate_url
    with pytest.raises(WeightVersionMismatch):
        await _run(fleet_url, http, _spec(url, "/evaluate")).run()


async def test_the_point_budget_bounds_a_delegate(
    fleet: tuple[FakeFleet, str], http: httpx.AsyncClient, delegate_url: tuple[FakeDelegate, str]  # noqa: F811
) -> None:
    _, fleet_url = fleet
    _, url = delegate_url
    from pinned_eval.gateway import AgentBudgetExceeded

    with pytest.raises(AgentBudgetExceeded, match="max_requests"):
        await _run(fleet_url, http, _spec(url, "/evaluate"), max_requests=1).run()
    # the point's generation calls count: 2 calls fit in max_requests 2, not after 1 prior call
    assert await _run(fleet_url, http, _spec(url, "/evaluate"), max_requests=2).run()
    with pytest.raises(AgentBudgetExceeded, match=r"max_requests \(2\)"):
        await _run(fleet_url, http, _spec(url, "/evaluate"), prior=1, max_requests=2).run()


def test_a_delegate_metric_named_like_pinned_evals_own_is_delegate_failed() -> None:
    from tasks.measure import _no_collision

    own = {"arith": {"eval/arith": 1.0, "eval/arith/weight_version/mean": 3.0}}
    _no_collision({"eval/arith/accuracy": 1.0}, own, ["skills"])
    for key in ("eval/arith", "eval/step", "eval/skipped_busy", "eval/datasets_run"):
        with pytest.raises(EvalSkipped, match=f"^delegate_failed: delegates \\['skills'\\]: metric '{key}' is one"):
            _no_collision({key: 1.0}, own, ["skills"])


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/error", "HTTP 503: 'overloaded' (after 1 attempt)"),
        ("/garbage", "reply is not JSON: b'<html>not json' (after 1 attempt)"),
        ("/redirect", "HTTP 307: '' (after 1 attempt)"),
        ("/flood", "reply over 4096 bytes (HTTP 200) (after 1 attempt)"),
        ("/gzip", "reply with Content-Encoding 'gzip' (identity was asked for) (after 1 attempt)"),
        ("/list", "reply is not a JSON object but list"),
        ("/nometrics", "reply has no 'raw_metrics' (keys: ['job_id'])"),
        ("/strings", "raw_metrics holds no numeric metric"),
    ],
)
async def test_a_failing_delegate_is_delegate_failed_naming_it(
    fleet: tuple[FakeFleet, str], http: httpx.AsyncClient, delegate_url: tuple[FakeDelegate, str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch, path: str, why: str,
) -> None:
    monkeypatch.setattr(delegate_client, "MAX_REPLY", 4096)
    fake, url = delegate_url
    with pytest.raises(DelegateFailed) as info:
        await _run(fleet[1], http, _spec(url, path)).run()
    assert info.value.reason == "delegate_failed"
    assert info.value.message == f"delegate 'nemo' ({url}{path}): {why}"
    assert fake.redirected == 0  # a redirect is never followed (the body holds the gateway's URL)


async def test_a_hang_is_cut_at_the_deadline_and_attempts_back_off_as_miles(
    delegate_url: tuple[FakeDelegate, str],
) -> None:
    fake, url = delegate_url
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    spec = _spec(url, "/hang", timeout_secs=0.2, max_retries=3)
    with pytest.raises(DelegateFailed, match=r"^delegate_failed: delegate 'nemo' .*: no reply within 0\.2 s "
                                             r"\(after 3 attempts\)$"):
        await post(spec, b"{}", sleep=sleep)
    assert slept == [2, 4] and len(fake.bodies) == 3


async def test_no_connection_is_delegate_failed() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    [spec] = parse_delegates("eval.delegate", [{"name": "n", "url": f"http://user:pw@127.0.0.1:{port}/e?key=s",
                                                "datasets": [{"name": "a"}]}])
    with pytest.raises(DelegateFailed) as info:
        await post(spec, b"{}")
    assert info.value.message.startswith(f"delegate 'n' (http://127.0.0.1:{port}/e): no connection (ConnectError")
    assert "pw" not in info.value.message and "key=s" not in info.value.message


def test_the_external_posture_refuses_a_suite_with_delegates(tmp_path: Path) -> None:
    from blocks import EvalSuiteBlock, ExternalBackendBlock, FleetBlock, SinksBlock, StagingBlock
    from pinned_eval.points import SourceKind
    from tasks.measure import MeasureInput, PointConfig, measure_external
    from tasks.snapshots import Snapshot

    suite = EvalSuite.from_miles_yaml(CONFIGS / "delegate_golden.yaml", check_imports=False)
    cfg = PointConfig(suite=EvalSuiteBlock(suite=suite), staging=StagingBlock(root=str(tmp_path)), sinks=SinksBlock(),
                      fleet=FleetBlock(name="f", mode="attach", engine_urls=["http://127.0.0.1:9"],
                                       router_url="http://127.0.0.1:9"),
                      backend=ExternalBackendBlock(backend="tests.nowhere:Backend", options={}))
    snap = Snapshot(path=str(tmp_path), owned=False, kind=SourceKind.HF, local_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"^eval\.delegate: the external posture hands the checkpoint"):
        measure_external(cfg, MeasureInput("r", 1, snap, suite.resolved(), {}))


def test_delegates_run_at_every_point_and_alone_where_no_dataset_is_due() -> None:
    """miles runs eval.delegate at every eval: the cadence cut (`flows.eval_point.due_suite`) keeps
    every delegate, and a step with no dataset due measures the delegates alone."""
    from flows.eval_point import due_suite
    from pinned_eval.suite import DatasetSpec

    [spec] = parse_delegates("eval.delegate", [_entry()])
    rare = DatasetSpec(name="rare", path="builtin:arith_add.jsonl", every_n_steps=5)
    cheap = DatasetSpec(name="cheap", path="builtin:arith_add.jsonl")
    suite = EvalSuite(datasets=(rare,), delegates=(spec,))

    alone, not_due = due_suite(suite, 3, final=False)
    assert (alone.datasets, alone.delegates, not_due) == ((), (spec,), ["rare"])
    assert (alone.resolved(), alone.defaults, alone.fallbacks) == ([], suite.defaults, suite.fallbacks)
    due, not_due = due_suite(suite, 5, final=False)
    assert (due.datasets, due.delegates, not_due) == ((rare,), (spec,), [])
    assert due_suite(suite, 3, final=True)[0].datasets == (rare,)
    both = EvalSuite(datasets=(cheap, rare), delegates=(spec,))
    assert due_suite(both, 3, final=False)[0].model_dump() == both.model_copy(
        update={"datasets": (cheap,)}).model_dump()

    with pytest.raises(EvalSkipped) as skipped:  # neither a dataset nor a delegate: nothing to measure
        due_suite(EvalSuite(datasets=(rare,)), 3, final=False)
    assert str(skipped.value) == "no_dataset_due: step 3: no dataset is due (every_n_steps)"
