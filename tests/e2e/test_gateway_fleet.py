"""The point gateway in front of a real CPU engine behind the real sglang-router (docs/agentic.md).

One engine at weight version 5 (qwen25 tool-call parser, scripted decoding so the tiny model emits
a tool call, then an answer once the tool's result is in the prompt). User code holds only the
gateway's URL and token: it runs a two-turn tool-calling chat in its own session, is refused by the
router itself with the gateway token, and the neighbour (a second uid) gets 401 from the gateway.
A gateway whose point pinned another version makes the point `pin_violation`; a used-up budget
makes it `agent_budget`; a sample over its turn limit gets 429 naming the limit. In adapter mode
(an adapter loaded on the engine under the version's name) the `/v1` routes through the gateway
answer exactly what the engine answers with that adapter named, not what the base weights answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pinned_eval.fleet.cpu_engine import CpuEngineArgs, engine_spec
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.fleet.keys import FleetKeys
from pinned_eval.fleet.launcher import LaunchedFleet, launch_fleet
from pinned_eval.gateway import GatewayLimits, PointGateway
from pinned_eval.rollout.session import PointSession
from pinned_eval.skip_mapping import skip_for
from tests.conftest import free_port
from tests.neighbour import Neighbour, run_as

pytestmark = pytest.mark.e2e

CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(2+2)"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "code_interpreter", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "What is 2+2?"}]
RULES = [{"prompt_contains": "<tool_response>", "completion": "The answer is 4."},
         {"prompt_contains": "What is 2+2?", "completion": CALL}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gateway-model") / "m", arch="llama", seed=0,
                           chat_template="chatml")


@pytest.fixture(scope="module")
def fleet(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedFleet]:
    base = tmp_path_factory.mktemp("gateway")
    rules = base / "rules.json"
    rules.write_text(json.dumps(RULES))
    keys = FleetKeys.resolve()
    spec = engine_spec(
        CpuEngineArgs(model_path=str(model), port=free_port(), weight_version="5", api_key=keys.api,
                      admin_api_key=keys.admin, tool_call_parser="qwen25", scripted_completions=str(rules)),
        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    launched = launch_fleet([spec], log_dir=base / "logs", keys=keys, ready_timeout_s=120)
    try:
        yield launched
    finally:
        launched.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


def gateway(
    fleet: LaunchedFleet, http: httpx.AsyncClient, version: str = "5", lora: str | None = None, **limits: Any
) -> PointGateway:
    assert fleet.router_url is not None and fleet.keys is not None
    gen = RouterGenerator(http, fleet.router_url, api_key=fleet.keys.api)
    session = PointSession(gen, expected_version=version, rid_prefix="p5", lora=lora)
    return PointGateway(session, GatewayLimits(**limits))


async def test_agent_turns_through_the_gateway(fleet: LaunchedFleet, http: httpx.AsyncClient) -> None:
    async with gateway(fleet, http, max_turns_per_sample=2) as gw:
        user = {"Authorization": f"Bearer {gw.token}"}
        base = gw.open_sample("math-0-0")
        first = (await http.post(f"{base}/v1/chat/completions", headers=user,
                                 json={"model": "m", "messages": ASK, "tools": TOOLS, "temperature": 0})).json()
        call = first["choices"][0]["message"]["tool_calls"][0]
        assert call["function"] == {"name": "code_interpreter", "arguments": '{"code": "print(2+2)"}'}
        turn2 = [*ASK, first["choices"][0]["message"], {"role": "tool", "tool_call_id": call["id"], "content": "4"}]
        second = (await http.post(f"{base}/v1/chat/completions", headers=user,
                                  json={"model": "m", "messages": turn2, "tools": TOOLS, "temperature": 0})).json()
        assert second["choices"][0]["message"]["content"] == "The answer is 4."
        over = await http.post(f"{base}/v1/chat/completions", headers=user, json={"model": "m", "messages": turn2})
        assert over.status_code == 429 and over.json()["message"].startswith("max_turns_per_sample reached")
        gen = (await http.post(f"{gw.base_url}/generate", headers=user,
                               json={"input_ids": [1, 5, 6], "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": 2, "temperature": 0}})).json()
        assert len(gen["meta_info"]["output_token_logprobs"]) == gen["meta_info"]["completion_tokens"] == 2
        # the gateway's token is not the fleet's key: the router itself refuses it
        assert fleet.router_url is not None
        direct = await http.post(f"{fleet.router_url}/generate", headers=user, json={"text": "x"})
        assert direct.status_code == 401
        turns = gw.transcript("math-0-0")
        assert [(t["route"], t["status"], t["weight_version"], t["finish_reason"]) for t in turns] == [
            ("/sessions/{id}/v1/chat/completions", 200, "5", "tool_calls"),
            ("/sessions/{id}/v1/chat/completions", 200, "5", "stop"),
        ]
        assert turns[0]["messages"] == ASK and turns[1]["text"] == "The answer is 4."
        assert turns[0]["tool_calls"] == [call] and turns[1]["tool_calls"] == []
        assert [(c.status, c.weight_version) for c in gw.calls] == [(200, "5"), (200, "5"), (429, None), (200, "5")]
        assert gw.violation is None and gw.sample_breaches == {"math-0-0": "max_turns_per_sample"}


async def test_another_version_is_a_pin_violation(fleet: LaunchedFleet, http: httpx.AsyncClient) -> None:
    async with gateway(fleet, http, version="6") as gw:  # this point pinned 6; the fleet serves 5
        r = await http.post(f"{gw.base_url}/v1/completions", headers={"Authorization": f"Bearer {gw.token}"},
                            json={"model": "m", "prompt": "1 2 3", "max_tokens": 2})
        assert r.status_code == 409 and "'5', expected '6'" in r.json()["message"]
        assert gw.violation is not None and skip_for(gw.violation) is not None
        assert skip_for(gw.violation)[0] == "pin_violation"  # type: ignore[index]


async def test_budget_breach_is_agent_budget(fleet: LaunchedFleet, http: httpx.AsyncClient) -> None:
    async with gateway(fleet, http, max_requests=1) as gw:
        user = {"Authorization": f"Bearer {gw.token}"}
        body = {"text": "1 2", "sampling_params": {"max_new_tokens": 1}}
        codes = [(await http.post(f"{gw.base_url}/generate", headers=user, json=body)).status_code for _ in range(2)]
        assert codes == [200, 429]
        assert skip_for(gw.violation) == ("agent_budget", "the point's max_requests (1) is used up")  # type: ignore[arg-type]


async def test_the_neighbour_gets_401(fleet: LaunchedFleet, http: httpx.AsyncClient, neighbour: Neighbour) -> None:
    code = (
        "import sys, urllib.request, urllib.error\n"
        "for path, auth in (('/v1/models', None), ('/generate', 'Bearer guess')):\n"
        "    req = urllib.request.Request(sys.argv[1] + path, data=None if path == '/v1/models' else b'{}',\n"
        "                                 headers={'Authorization': auth} if auth else {})\n"
        "    try:\n"
        "        print(urllib.request.urlopen(req, timeout=10).status)\n"
        "    except urllib.error.HTTPError as e:\n"
        "        print(e.code)\n"
    )
    async with gateway(fleet, http) as gw:
        out = await asyncio.to_thread(run_as, neighbour, code, gw.base_url)
        assert out.stdout.split() == ["401", "401"], out.stderr
        assert [(c.route, c.status) for c in gw.calls] == [("/v1/models", 401), ("/generate", 401)]


async def test_v1_calls_in_adapter_mode_run_on_the_pinned_adapter(
    fleet: LaunchedFleet, model: Path, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    from engine.tiny_model import make_tiny_adapter

    assert fleet.router_url is not None and fleet.keys is not None
    engine, admin = fleet.engine_urls[0], {"Authorization": f"Bearer {fleet.keys.admin}"}
    adapter = make_tiny_adapter(model, tmp_path / "adapter", seed=3, scale=2.0)
    loaded = await http.post(f"{engine}/load_lora_adapter", json={"lora_name": "5", "lora_path": str(adapter)},
                             headers=admin)
    assert loaded.status_code == 200, loaded.text
    fleet_key = {"Authorization": f"Bearer {fleet.keys.api}"}
    calls = {"/v1/completions": {"model": "m", "prompt": "7 8 9", "max_tokens": 6, "temperature": 0},
             "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
                                      "max_tokens": 6, "temperature": 0}}

    def text(reply: httpx.Response) -> str:
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        return str(choice["text"] if "text" in choice else choice["message"]["content"])

    try:
        async with gateway(fleet, http, lora="5") as gw:
            user = {"Authorization": f"Bearer {gw.token}"}
            base_url = gw.open_sample("lora-0-0")
            for route, body in calls.items():
                on_base = text(await http.post(f"{fleet.router_url}{route}", headers=fleet_key, json=body))
                on_adapter = text(await http.post(f"{fleet.router_url}{route}", headers=fleet_key,
                                                  json={**body, "lora_path": "5"}))
                assert on_adapter != on_base  # the adapter changes the greedy answer
                assert text(await http.post(f"{base_url}{route}", headers=user, json=body)) == on_adapter
                assert text(await http.post(f"{gw.base_url}{route}", headers=user,
                                            json={**body, "model": "m:5"})) == on_adapter
                other = await http.post(f"{base_url}{route}", headers=user, json={**body, "lora_path": "4"})
                assert other.status_code == 400 and "lora_path: '4' is not this point's adapter '5'" in other.text
            assert [(t["route"], t["weight_version"]) for t in gw.transcript("lora-0-0")] == [
                ("/sessions/{id}/v1/completions", "5"), ("/sessions/{id}/v1/chat/completions", "5")]
            assert gw.violation is None and gw.session.counters.requests == 4
    finally:
        unloaded = await http.post(f"{engine}/unload_lora_adapter", json={"lora_name": "5"}, headers=admin)
        assert unloaded.status_code == 200, unloaded.text
