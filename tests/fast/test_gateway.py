"""The point gateway (`pinned_eval.gateway`) over real HTTP on loopback: user code's calls reach a
recording fake fleet (it stands for the router and its GPU engines) through a real `PointSession`.

Checked: the fleet's key injected and the caller's headers dropped, every reply's version checked
(a mismatch -> `violation` -> `pin_violation`), budgets (-> `agent_budget`) and per-sample limits
(429 naming the limit), 4xx for malformed bodies before anything is forwarded, per-sample
transcripts, 401 without the token, and nothing listening after the context exits.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pinned_eval.fleet.errors import WeightVersionMismatch
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.gateway import AgentBudgetExceeded, GatewayLimits, PointGateway
from pinned_eval.rollout.session import PointSession
from pinned_eval.skip_mapping import skip_for

FLEET_KEY = "fleet-api-key-never-shown"
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


class FakeFleet:
    """Answers `/generate` and `/v1/*` like the router over CPU engines at `version`; records every
    request's path, headers and body. `abort_next` aborts that many requests first."""

    def __init__(self) -> None:
        self.version = "7"
        self.abort_next = 0
        self.release = asyncio.Event()
        self.seen: list[tuple[str, dict[str, str], Any]] = []
        self.app = Starlette(routes=[
            Route("/generate", self.generate, methods=["POST"]),
            Route("/v1/completions", self.v1, methods=["POST"]),
            Route("/v1/chat/completions", self.v1, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
        ])

    async def _seen(self, request: Request) -> Any:
        body = await request.json() if request.method == "POST" else None
        self.seen.append((request.url.path, dict(request.headers), body))
        return body

    async def generate(self, request: Request) -> JSONResponse:
        body = await self._seen(request)
        if body.get("text") == "hang":
            await self.release.wait()  # a call that never ends until the test releases it
        finish = {"type": "stop", "matched": 2}
        if self.abort_next:
            self.abort_next -= 1
            finish = {"type": "abort", "message": "weights loading"}
        return JSONResponse({"text": f"echo:{body.get('text')}", "output_ids": [5, 6],
                             "meta_info": {"id": body.get("rid"), "finish_reason": finish, "prompt_tokens": 3,
                                           "completion_tokens": 2, "weight_version": self.version}})

    async def v1(self, request: Request) -> JSONResponse:
        body = await self._seen(request)
        if body.get("model") == "bad":
            return JSONResponse({"object": "error", "message": "model: unknown", "code": 400}, status_code=400)
        chat = request.url.path.endswith("chat/completions")
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
             "finish_reason": "tool_calls"}
            if chat else {"index": 0, "text": "done", "finish_reason": "stop"}
        )
        return JSONResponse({"id": "x", "choices": [choice], "usage": {"prompt_tokens": 4, "completion_tokens": 1},
                             "metadata": {"weight_version": self.version}})

    async def models(self, request: Request) -> JSONResponse:
        await self._seen(request)
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[FakeFleet, str]]:
    fake = FakeFleet()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake.app, lifespan="off", log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # uvicorn offers no event; its own flag, polled
        await asyncio.sleep(0.01)
    try:
        yield fake, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def _gateway(url: str, http: httpx.AsyncClient, **limits: Any) -> PointGateway:
    gen = RouterGenerator(http, url, api_key=FLEET_KEY, abort_retries=2)
    session = PointSession(gen, expected_version="7", rid_prefix="pt3")
    return PointGateway(session, GatewayLimits(**limits))


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as client:
        yield client


def auth(gw: PointGateway, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {gw.token}", **extra}


async def test_forwards_with_the_fleet_key_only(fleet: tuple[FakeFleet, str], http: httpx.AsyncClient) -> None:
    fake, url = fleet
    async with _gateway(url, http) as gw:
        assert gw.base_url.startswith("http://127.0.0.1:")
        r = await http.post(f"{gw.base_url}/generate", headers=auth(gw, **{"X-SMG-Routing-Key": "s1", "X-Other": "1"}),
                            json={"text": "hi", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True})
        assert r.status_code == 200
        assert r.json()["text"] == "echo:hi"
        path, headers, body = fake.seen[-1]
        assert path == "/generate"
        assert headers["authorization"] == f"Bearer {FLEET_KEY}"
        assert "x-smg-routing-key" not in headers and "x-other" not in headers
        assert body == {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                        "rid": "pt3-gw1"}
        models = await http.get(f"{gw.base_url}/v1/models", headers=auth(gw))
        assert models.json()["data"][0]["id"] == "m"
        c = gw.session.counters  # a model call counted, the model listing not
        assert (c.requests, c.completed, c.prompt_tokens, c.completion_tokens) == (1, 1, 3, 2)
        health = await http.get(f"{gw.base_url}/health")
        assert health.json() == {"status": "ok"}
        rec = gw.calls[0]
        assert (rec.route, rec.sample_key, rec.status, rec.weight_version, rec.prompt_tokens,
                rec.completion_tokens, rec.error) == ("/generate", "s1", 200, "7", 3, 2, None)
        assert gw.transcript("s1")[0]["text"] == "echo:hi"
        assert gw.violation is None
        port = int(gw.base_url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):  # nothing left listening
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


async def test_token_required_on_every_route_but_health(fleet: tuple[FakeFleet, str], http: httpx.AsyncClient) -> None:
    fake, url = fleet
    async with _gateway(url, http) as gw:
        sid = gw.open_sample("a").rsplit("/", 1)[1]
        for bad in ({}, {"Authorization": f"Bearer {FLEET_KEY}"}, {"Authorization": gw.token}):
            for method, path in (("GET", "/v1/models"), ("POST", "/generate"), ("POST", "/v1/completions"),
                                 ("POST", "/v1/chat/completions"), ("POST", f"/sessions/{sid}/v1/chat/completions")):
                r = await http.request(method, gw.base_url + path, headers=bad, json={"text": "x"})
                assert r.status_code == 401, (path, bad)
                assert "bearer token" in r.json()["message"]
    assert fake.seen == []


async def test_version_mismatch_is_a_pin_violation(fleet: tuple[FakeFleet, str], http: httpx.AsyncClient) -> None:
    fake, url = fleet
    fake.version = "8"
    async with _gateway(url, http) as gw:
        base = gw.open_sample("s")
        r = await http.post(f"{base}/v1/chat/completions", headers=auth(gw),
                            json={"model": "m", "messages": [{"role": "user", "content": "q"}]})
        assert r.status_code == 409
        assert "'8', expected '7'" in r.json()["message"] and "pin_violation" in r.json()["message"]
        assert isinstance(gw.violation, WeightVersionMismatch)
        assert skip_for(gw.violation)[0] == "pin_violation"  # type: ignore[index]
        fake.version = "7"  # every later call is refused too, without reaching the fleet
        sent = len(fake.seen)
        again = await http.post(f"{gw.base_url}/generate", headers=auth(gw), json={"text": "x"})
        assert again.status_code == 409 and len(fake.seen) == sent
        assert [c.status for c in gw.calls] == [409, 409]


async def test_aborts_are_retried_with_fresh_rids(fleet: tuple[FakeFleet, str], http: httpx.AsyncClient) -> None:
    fake, url = fleet
    fake.abort_next = 1
    async with _gateway(url, http) as gw:
        r = await http.post(f"{gw.base_url}/generate", headers=auth(gw), json={"text": "x"})
        assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "stop"
    assert [b["rid"] for _, _, b in fake.seen] == ["pt3-gw1", "pt3-gw1.retry1"]


async def test_point_budget_is_agent_budget(fleet: tuple[FakeFleet, str], http: httpx.AsyncClient) -> None:
    fake, url = fleet
    async with _gateway(url, http, max_requests=2) as gw:
        for _ in range(2):
            assert (await http.post(f"{gw.base_url}/v1/completions", headers=auth(gw),
                                    json={"model": "m", "prompt": "p"})).status_code == 200
        r = await http.post(f"{gw.base_url}/v1/completions", headers=auth(gw), json={"model": "m", "prompt": "p"})
        assert r.status_code == 429 and r.json()["message"].startswith("max_requests reached")
        assert isinstance(gw.violation, AgentBudgetExceeded)
        assert skip_for(gw.violation) == ("agent_budget", "the point's max_requests (2) is used up")
    assert len(fake.seen) == 2
    async with _gateway(url, http, max_tokens=6) as gw:  # 5 tokens per call: the second crosses it
        codes = [(await http.post(f"{gw.base_url}/generate", headers=auth(gw), json={"text": "x"})).status_code
                 for _ in range(3)]
        assert codes == [200, 200, 429]
        assert isinstance(gw.violation, AgentBudgetExceeded) and gw.violation.limit == "max_tokens"


async def test_sample_limits_refuse_that_sample_only(fleet: tuple[FakeFleet, str], http: httpx.AsyncClient) -> None:
    _, url = fleet
    chat = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    async with _gateway(url, http, max_turns_per_sample=2) as gw:
        a, b = gw.open_sample("a"), gw.open_sample("b")
        codes = [(await http.post(f"{a}/v1/chat/completions", headers=auth(gw), json=chat)).status_code
                 for _ in range(3)]
        assert codes == [200, 200, 429]
        refused = gw.calls[-1]
        assert refused.error is not None and refused.error.startswith("max_turns_per_sample reached")
        assert (await http.post(f"{b}/v1/chat/completions", headers=auth(gw), json=chat)).status_code == 200
        assert gw.sample_breaches == {"a": "max_turns_per_sample"} and gw.violation is None
        turns = gw.transcript("a")
        assert [t["tool_calls"] for t in turns] == [[TOOL_CALL], [TOOL_CALL]]
        assert turns[0]["messages"] == chat["messages"] and turns[0]["finish_reason"] == "tool_calls"
        assert (turns[0]["weight_version"], turns[0]["prompt_tokens"], turns[0]["completion_tokens"]) == ("7", 4, 1)
    async with _gateway(url, http, max_tokens_per_sample=5) as gw:  # header-keyed sample
        key = {"X-SMG-Routing-Key": "k"}
        codes = [(await http.post(f"{gw.base_url}/generate", headers=auth(gw, **key), json={"text": "x"})).status_code
                 for _ in range(2)]
        assert codes == [200, 429] and gw.sample_breaches == {"k": "max_tokens_per_sample"}


async def test_sample_wall_time(fleet: tuple[FakeFleet, str], http: httpx.AsyncClient) -> None:
    fake, url = fleet
    async with _gateway(url, http, sample_wall_s=1e-6) as gw:  # over before its first call
        base = gw.open_sample("slow")
        r = await http.post(f"{base}/generate", headers=auth(gw), json={"text": "x"})
        assert r.status_code == 429 and "sample_wall_s" in r.json()["message"]
        assert gw.sample_breaches == {"slow": "sample_wall_s"} and fake.seen == []
    async with _gateway(url, http, sample_wall_s=0.5) as gw:  # a call in flight at the deadline is cut off
        base = gw.open_sample("hung")
        try:
            r = await http.post(f"{base}/generate", headers=auth(gw), json={"text": "hang"})
        finally:
            fake.release.set()
        assert r.status_code == 429 and r.json()["message"].startswith("sample_wall_s reached")
        assert gw.sample_breaches == {"hung": "sample_wall_s"} and [s[0] for s in fake.seen] == ["/generate"]


async def test_an_unreachable_fleet_is_502(http: httpx.AsyncClient) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: connections refused
        async with _gateway(closed, http) as gw:
            r = await http.post(f"{gw.base_url}/generate", headers=auth(gw), json={"text": "x"})
            assert r.status_code == 502 and "unreachable" in r.json()["message"]
            assert gw.violation is None and gw.calls[-1].status == 502


@pytest.mark.parametrize(("path", "content", "status", "says"), [
    ("/generate", b"{not json", 400, "not JSON"),
    ("/generate", b"[1, 2]", 400, "one JSON object"),
    ("/generate", b'{"sampling_params": {}}', 400, "missing field 'text' or 'input_ids'"),
    ("/v1/chat/completions", b'{"model": "m"}', 400, "missing field 'messages'"),
    ("/v1/completions", b'{"model": "m", "prompt": "p", "stream": true}', 400, "stream: true"),
    ("/v1/completions", b"x" * (8 * 1024 * 1024 + 1), 413, "request body over"),
    ("/sessions/nope/generate", b'{"text": "x"}', 404, "unknown session"),
])
async def test_malformed_requests_are_4xx_and_not_forwarded(
    fleet: tuple[FakeFleet, str], http: httpx.AsyncClient, path: str, content: bytes, status: int, says: str
) -> None:
    fake, url = fleet
    async with _gateway(url, http) as gw:
        r = await http.post(gw.base_url + path, headers=auth(gw), content=content)
        assert r.status_code == status and says in r.json()["message"]
        assert gw.calls[-1].status == status
    assert fake.seen == []


async def test_upstream_4xx_passes_through(fleet: tuple[FakeFleet, str], http: httpx.AsyncClient) -> None:
    _, url = fleet
    async with _gateway(url, http) as gw:
        r = await http.post(f"{gw.base_url}/v1/completions", headers=auth(gw), json={"model": "bad", "prompt": "p"})
        assert (r.status_code, r.json()["message"]) == (400, "model: unknown")
        assert gw.violation is None


def test_limits_are_strict() -> None:
    with pytest.raises(ValidationError, match="max_turn"):
        GatewayLimits(max_turn=3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="max_requests"):
        GatewayLimits(max_requests=0)
    assert GatewayLimits().max_tokens is None


class _BrokenSession(PointSession):
    async def forward(self, method: str, path: str, body: dict[str, Any] | None, *, rid: str,
                      send: Any = None) -> tuple[int, Any]:
        raise ValueError("injected fault")


async def test_a_gateway_fault_is_one_line_500_and_recorded(http: httpx.AsyncClient) -> None:
    session = _BrokenSession(RouterGenerator(http, "http://127.0.0.1:9"), expected_version="7", rid_prefix="p")
    async with PointGateway(session, GatewayLimits()) as gw:
        r = await http.post(f"{gw.base_url}/generate", headers=auth(gw), json={"text": "x"})
        assert (r.status_code, r.json()["message"]) == (500, "point gateway error: ValueError: injected fault")
        assert (gw.calls[-1].status, gw.calls[-1].error) == (500, "point gateway error: ValueError: injected fault")


@pytest.mark.parametrize(("payload", "ok"), [
    ({"meta_info": {"weight_version": "7"}}, True),
    ([{"meta_info": {"weight_version": "7"}}, {"meta_info": {"weight_version": "7"}}], True),
    ([{"meta_info": {"weight_version": "7"}}, {"meta_info": {"weight_version": "6"}}], False),  # a batch item
    ({"meta_info": {"weight_version": "7", "weight_versions": [{"version": "6"}, {"version": "7"}]}}, False),
    ({"metadata": {"weight_version": "7"}, "choices": []}, True),
    ({"choices": []}, False),  # a reply naming no version
    ({"metadata": {"weight_version": 7}}, False),
])
def test_every_result_of_a_raw_reply_must_name_the_version(payload: Any, ok: bool) -> None:
    from pinned_eval.fleet.generate import check_reply_version

    if ok:
        assert check_reply_version(payload, "7") == "7"
    else:
        with pytest.raises(WeightVersionMismatch):
            check_reply_version(payload, "7")


def test_aborts_are_seen_on_generate_and_v1() -> None:
    from pinned_eval.fleet.generate import reply_aborted

    assert reply_aborted({"meta_info": {"finish_reason": {"type": "abort"}}})
    stop, abort = ({"meta_info": {"finish_reason": {"type": t}}} for t in ("stop", "abort"))
    assert reply_aborted([stop, abort]) and not reply_aborted([stop])
    assert reply_aborted({"choices": [{"finish_reason": "abort"}]})
    assert not reply_aborted({"choices": [{"finish_reason": "stop"}], "meta_info": None})
