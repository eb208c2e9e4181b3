"""What survives the real sglang-router: logprobs on `/generate`, `/v1/completions`, tool calls on
`/v1/chat/completions`, and the weight version on every reply (docs/engine.md, "Through the router").

A CPU engine (qwen25 tool-call parser, scripted decoding so the tiny model emits a tool call)
behind the real sglang-router 0.3.2. Every request goes once straight to an engine and once
through the router; the replies are compared field by field. The replies are also checked
against SGLang 0.5.23's own schema: `/generate` decoded with its `api_types` (logprob triples
included), `/v1` replies against the field lists of its OpenAI `protocol.py` classes.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from pinned_eval.fleet.cpu_engine import CpuEngineArgs, engine_spec
from pinned_eval.fleet.keys import FleetKeys
from pinned_eval.fleet.launcher import LaunchedFleet, launch_fleet
from tests.conftest import free_port
from tests.e2e import test_sglang_contract as sglang_contract
from tests.e2e.test_sglang_contract import OPENAI_PROTOCOL, _conforms, _fields

# the real SGLang wheel and its api_types (session fixtures of the /generate schema check)
sglang_wheel = sglang_contract.sglang_wheel
api_types = sglang_contract.api_types

pytestmark = pytest.mark.e2e

QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedFleet]:
    from engine.tiny_model import make_tiny_model

    base = tmp_path_factory.mktemp("v1-contract")
    model = make_tiny_model(base / "m", arch="llama", seed=0, chat_template="chatml")
    rules = base / "rules.json"
    rules.write_text(json.dumps([{"prompt_contains": '"name": "get_weather"', "completion": QWEN_CALL}]))
    keys = FleetKeys.resolve()
    specs = [
        engine_spec(
            CpuEngineArgs(model_path=str(model), port=free_port(), weight_version="5", api_key=keys.api,
                          admin_api_key=keys.admin, tool_call_parser="qwen25", scripted_completions=str(rules)),
            env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
        for _ in range(1)
    ]
    launched = launch_fleet(specs, log_dir=base / "logs", keys=keys, ready_timeout_s=120)
    try:
        yield launched
    finally:
        launched.stop()


def both(fleet: LaunchedFleet, path: str, body: dict[str, Any] | None = None) -> tuple[httpx.Response, httpx.Response]:
    """The same request straight to engine 0 and through the router."""
    assert fleet.keys is not None and fleet.router_url is not None
    headers = {"Authorization": f"Bearer {fleet.keys.api}"}
    method = "GET" if body is None else "POST"
    direct = httpx.request(method, fleet.engine_urls[0] + path, json=body, headers=headers, timeout=120)
    routed = httpx.request(method, fleet.router_url + path, json=body, headers=headers, timeout=120)
    return direct, routed


def without(reply: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in reply.items() if k not in keys}


GENERATE = {
    "input_ids": [1, 5, 6, 7], "rid": "contract-lp", "sampling_params": {"max_new_tokens": 3, "temperature": 0},
    "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True,
}


def test_generate_logprobs_survive_the_router_and_decode_under_sglangs_schema(
    fleet: LaunchedFleet, api_types: ModuleType
) -> None:
    direct, routed = (r.json() for r in both(fleet, "/generate", GENERATE))
    assert without(routed["meta_info"], "e2e_latency") == without(direct["meta_info"], "e2e_latency")
    assert without(routed, "meta_info") == without(direct, "meta_info")
    meta = routed["meta_info"]
    assert (meta["id"], meta["weight_version"]) == ("contract-lp", "5")  # rid and version pass through
    assert [t[1] for t in meta["output_token_logprobs"]] == routed["output_ids"]
    assert [t[1] for t in meta["input_token_logprobs"]] == GENERATE["input_ids"]
    api_types.GenerateRequest.from_json_value(GENERATE)  # SGLang's request gate accepts the logprob fields
    decoded = api_types.GenerateResponse.from_json_value(routed).meta_info
    assert decoded.weight_version == "5"
    assert [(e.logprob, e.token_id, e.text) for e in decoded.output_token_logprobs] == [
        tuple(t) for t in meta["output_token_logprobs"]
    ]
    assert decoded.input_token_logprobs[0].logprob is None and len(decoded.input_top_logprobs) == 4


def test_completions_survive_with_string_prompts_token_ids_are_refused_by_the_router(
    fleet: LaunchedFleet, sglang_wheel: Path
) -> None:
    protocol = zipfile.ZipFile(sglang_wheel).read(OPENAI_PROTOCOL)
    body = {"model": "tiny", "prompt": ["What is", "1+1="], "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 1, "rid": "contract-cmpl", "return_token_ids": True}
    direct, routed = (r.json() for r in both(fleet, "/v1/completions", body))
    assert without(routed, "created") == without(direct, "created")  # every field, logprobs included
    assert (routed["id"], routed["model"], routed["metadata"]) == ("contract-cmpl_0", "tiny", {"weight_version": "5"})
    _conforms(routed, _fields(protocol, "CompletionResponse"), "CompletionResponse")
    for choice in routed["choices"]:
        _conforms(choice, _fields(protocol, "CompletionResponseChoice"), "CompletionResponseChoice")
        _conforms(choice["logprobs"], _fields(protocol, "LogProbs"), "LogProbs")
        assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["token_ids"]) == 1
    _conforms(routed["usage"], _fields(protocol, "UsageInfo"), "UsageInfo")
    # lm-eval's default (tokenized_requests=True) sends token ids: the router refuses them, the engine takes them
    ids = {**body, "prompt": [[1, 5, 6, 7]]}
    direct_ids, routed_ids = both(fleet, "/v1/completions", ids)
    assert direct_ids.status_code == 200 and routed_ids.status_code == 422
    assert "prompt: data did not match any variant of untagged enum StringOrArray" in routed_ids.text
    no_model = both(fleet, "/v1/completions", without(body, "model"))
    assert no_model[0].status_code == 200 and no_model[1].status_code == 422
    assert "missing field `model`" in no_model[1].text


def test_chat_tool_calls_survive_the_router_meta_info_and_rid_do_not(fleet: LaunchedFleet, sglang_wheel: Path) -> None:
    protocol = zipfile.ZipFile(sglang_wheel).read(OPENAI_PROTOCOL)
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 200, "logprobs": True,
            "top_logprobs": 1, "return_meta_info": True, "rid": "contract-chat", "return_token_ids": True}
    direct, routed = (r.json() for r in both(fleet, "/v1/chat/completions", body))
    for reply in (direct, routed):
        (choice,) = reply["choices"]
        assert (choice["finish_reason"], choice["message"]["content"], reply["metadata"]) == (
            "tool_calls", "", {"weight_version": "5"},
        )
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        _conforms(reply, _fields(protocol, "ChatCompletionResponse"), "ChatCompletionResponse")
        _conforms(choice, _fields(protocol, "ChatCompletionResponseChoice"), "ChatCompletionResponseChoice")
        _conforms(choice["message"], _fields(protocol, "ChatMessage"), "ChatMessage")
        _conforms(call, _fields(protocol, "ToolCall"), "ToolCall")
    assert routed["choices"][0]["logprobs"] == direct["choices"][0]["logprobs"]  # logprobs survive
    assert direct["id"] == "contract-chat" and direct["choices"][0]["meta_info"]["weight_version"] == "5"
    assert routed["id"].startswith("chatcmpl-")  # SGLang's chat extensions are dropped by the router:
    assert {"meta_info", "prompt_token_ids", "response_token_ids"} <= set(direct["choices"][0])
    assert not {"meta_info", "prompt_token_ids", "response_token_ids"} & set(routed["choices"][0])
    pre = {"model": "tiny", "messages": ASK, "input_ids": [1, 5, 6], "max_tokens": 1}
    direct_pre, routed_pre = (r.json()["usage"]["prompt_tokens"] for r in both(fleet, "/v1/chat/completions", pre))
    rendered = both(fleet, "/v1/chat/completions", without(pre, "input_ids"))[0].json()["usage"]["prompt_tokens"]
    assert (direct_pre, routed_pre) == (3, rendered)  # through the router `input_ids` is lost: the template ran
    assert both(fleet, "/v1/chat/completions", without(body, "model"))[1].json()["model"] == "unknown"


def test_the_router_answers_v1_models_itself(fleet: LaunchedFleet) -> None:
    direct, routed = (r.json() for r in both(fleet, "/v1/models"))
    path = direct["data"][0]["root"]
    assert routed == {"object": "list", "data": [{"id": path, "object": "model", "owned_by": "local"}]}


def test_a_new_weight_version_names_every_reply_through_the_router(fleet: LaunchedFleet) -> None:
    assert fleet.keys is not None and fleet.router_url is not None
    admin = {"Authorization": f"Bearer {fleet.keys.admin}"}
    try:
        for url in fleet.engine_urls:
            r = httpx.post(f"{url}/update_weight_version", json={"new_version": "6"}, headers=admin, timeout=30)
            assert r.json()["success"] is True
        headers = {"Authorization": f"Bearer {fleet.keys.api}"}
        for _ in range(2):
            gen = httpx.post(f"{fleet.router_url}/generate", json=GENERATE, headers=headers, timeout=60).json()
            cmpl = httpx.post(f"{fleet.router_url}/v1/completions", headers=headers, timeout=60,
                              json={"model": "m", "prompt": "hi", "max_tokens": 1}).json()
            chat = httpx.post(f"{fleet.router_url}/v1/chat/completions", headers=headers, timeout=60,
                              json={"model": "m", "messages": ASK, "max_tokens": 1}).json()
            assert (gen["meta_info"]["weight_version"], cmpl["metadata"], chat["metadata"]) == (
                "6", {"weight_version": "6"}, {"weight_version": "6"},
            )
    finally:
        for url in fleet.engine_urls:
            httpx.post(f"{url}/update_weight_version", json={"new_version": "5"}, headers=admin, timeout=30)


def test_lm_evals_sglang_generate_loglikelihood_batch_passes_the_router(fleet: LaunchedFleet) -> None:
    """lm-eval's `sglang-generate` scores a batch of token-id prompts through `/generate`."""
    context, prompts = [1, 5, 6], [[1, 5, 6, 7, 8], [1, 5, 6, 9]]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "logprob_start_len": 0, "top_logprobs_num": 1, "return_logprob": True}
    direct, routed = (r.json() for r in both(fleet, "/generate", body))
    assert isinstance(routed, list) and len(routed) == 2
    for d, r, ids in zip(direct, routed, prompts, strict=True):
        meta = r["meta_info"]
        assert meta["input_token_logprobs"] == d["meta_info"]["input_token_logprobs"]
        assert [t[1] for t in meta["input_token_logprobs"]] == ids and meta["weight_version"] == "5"
        # lm-eval's parse_logprobs: sum over the continuation, top-1 rows beside it
        continuation = meta["input_token_logprobs"][len(context):]
        assert len(continuation) == len(ids) - len(context) and all(t[0] <= 0 for t in continuation)
        assert all(len(row) == 1 for row in meta["input_top_logprobs"][len(context):])
