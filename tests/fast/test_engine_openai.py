"""The CPU engine's OpenAI-compatible routes and scripted decoding, in process (real tiny model).

Tool calls need a model that emits them: the engines here run with `--scripted-completions`
rules (engine/scripted.py). The rule that emits a `get_weather` call matches on the tool's JSON
as the chat template renders it, so it fires only when `tools` reached the template.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.launch import EngineArgs
from engine.scripted import ScriptError, load_rules
from engine.server import create_app

QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
RULES = [
    {"prompt_contains": "<tool_response>\n18C", "completion": "It is 18C in Paris."},
    {"prompt_contains": "hermes please", "completion": HERMES_CALL},
    {"prompt_contains": '"name": "get_weather"', "completion": QWEN_CALL},
    {"prompt_contains": "say hi", "completion": "hi there"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("engine-v1") / "m", arch="llama", seed=0, chat_template="chatml")


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "rules.json"
    path.write_text(json.dumps(RULES), encoding="utf-8")
    return path


def _client(model_dir: Path, rules: Path, parser: str | None) -> Iterator[TestClient]:
    args = EngineArgs(model_path=str(model_dir), port=1, weight_version="7", tool_call_parser=parser,
                      scripted_completions=str(rules))
    with TestClient(create_app(args)) as c:
        yield c


@pytest.fixture(scope="module")
def qwen(model_dir: Path, rules_file: Path) -> Iterator[TestClient]:
    yield from _client(model_dir, rules_file, "qwen25")


@pytest.fixture(scope="module")
def hermes(model_dir: Path, rules_file: Path) -> Iterator[TestClient]:
    yield from _client(model_dir, rules_file, "hermes")


def post(client: TestClient, path: str, body: dict, status: int = 200) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def chat(client: TestClient, **body) -> dict:
    return post(client, "/v1/chat/completions", {"max_tokens": 200, **body})


def rendered_len(model_dir: Path, messages: list[dict], tools: list[dict] | None) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def test_chat_tool_call_parsed_like_sglang_qwen25(qwen: TestClient, model_dir: Path) -> None:
    out = chat(qwen, messages=ASK, tools=TOOLS, model="tiny")
    assert set(out) == {"id", "object", "created", "model", "choices", "usage", "metadata"}
    assert (out["object"], out["model"], out["metadata"]) == ("chat.completion", "tiny", {"weight_version": "7"})
    (choice,) = out["choices"]
    assert (choice["finish_reason"], choice["matched_stop"], choice["logprobs"]) == ("tool_calls", None, None)
    message = choice["message"]
    assert (message["role"], message["content"], message["reasoning_content"]) == ("assistant", "", None)
    (call,) = message["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert call | {"id": "-"} == {"id": "-", "index": 0, "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    usage = out["usage"]
    assert usage["prompt_tokens"] == rendered_len(model_dir, ASK, TOOLS)  # the tools reached the template
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_without_tools_or_with_tool_choice_none_the_template_gets_no_tools(qwen: TestClient, model_dir: Path) -> None:
    for body in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        # greedy and EOS ignored: an unseeded draw at temperature 1 may end on EOS at the first token
        out = chat(qwen, messages=ASK, max_tokens=4, temperature=0, ignore_eos=True, **body)
        choice = out["choices"][0]
        assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length"
        assert out["usage"]["prompt_tokens"] == rendered_len(model_dir, ASK, None)


def test_hermes_format_needs_the_hermes_parser(qwen: TestClient, hermes: TestClient) -> None:
    ask = [{"role": "user", "content": "hermes please"}]
    parsed = chat(hermes, messages=ask, tools=TOOLS)["choices"][0]
    assert parsed["finish_reason"] == "tool_calls"
    assert parsed["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    raw = chat(qwen, messages=ask, tools=TOOLS)["choices"][0]  # qwen25 wants the newlines
    assert (raw["message"]["content"], raw["finish_reason"], raw["matched_stop"]) == (HERMES_CALL, "stop", EOS)
    assert "tool_calls" not in raw["message"]


def test_without_a_parser_the_call_stays_text(model_dir: Path, rules_file: Path) -> None:
    for client in _client(model_dir, rules_file, None):
        choice = chat(client, messages=ASK, tools=TOOLS)["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (QWEN_CALL, "stop")
        assert client.get("/model_info").json()["tool_call_parser"] is None


def test_a_tool_result_turn_renders_and_answers(qwen: TestClient) -> None:
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    out = chat(qwen, messages=turns, tools=TOOLS, logprobs=True, top_logprobs=2, return_meta_info=True)
    choice = out["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"], choice["matched_stop"]) == (
        "It is 18C in Paris.", "stop", EOS,
    )
    content = choice["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    assert "".join(c["token"] for c in content) == "It is 18C in Paris.</s>"  # the EOS is an output token
    assert all(bytes(c["bytes"]).decode() == c["token"] for c in content[:-1])
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    meta = choice["meta_info"]
    assert meta["weight_version"] == "7"
    assert [t[0] for t in meta["output_token_logprobs"]] == [c["logprob"] for c in content]
    assert qwen.get("/model_info").json()["tool_call_parser"] == "qwen25"


def test_scripted_decoding_obeys_the_request_limits(qwen: TestClient) -> None:
    out = post(qwen, "/generate", {"text": "say hi", "sampling_params": {"max_new_tokens": 50}})
    assert (out["text"], out["meta_info"]["finish_reason"]) == ("hi there", {"type": "stop", "matched": EOS})
    cut = post(qwen, "/generate", {"text": "say hi", "sampling_params": {"max_new_tokens": 2}})
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    stopped = post(qwen, "/generate", {"text": "say hi", "sampling_params": {"max_new_tokens": 50, "stop": ["ere"]}})
    assert (stopped["text"], stopped["meta_info"]["finish_reason"]) == ("hi th", {"type": "stop", "matched": "ere"})
    unscripted = post(qwen, "/generate", {"text": "say ho", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert unscripted["output_ids"][:2] != cut["output_ids"]  # no rule matches: the model decodes


def test_completions_plain_equals_generate(qwen: TestClient) -> None:
    body = {"prompt": "What is 2 plus 2?", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    out = post(qwen, "/v1/completions", body)
    greedy5 = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    native = post(qwen, "/generate", {"text": body["prompt"], "sampling_params": greedy5})
    assert set(out) == {"id", "object", "created", "model", "choices", "usage", "metadata"}
    assert (out["object"], out["model"], out["metadata"]) == ("text_completion", "default", {"weight_version": "7"})
    assert out["choices"] == [{"index": 0, "text": native["text"], "logprobs": None, "finish_reason": "length",
                               "matched_stop": None}]
    assert out["usage"] | {"completion_tokens_details": None} == {
        "prompt_tokens": native["meta_info"]["prompt_tokens"], "completion_tokens": 5,
        "total_tokens": native["meta_info"]["prompt_tokens"] + 5, "prompt_tokens_details": None,
        "reasoning_tokens": 0, "completion_tokens_details": None,
    }
    default = post(qwen, "/v1/completions", {"prompt": "hello", "ignore_eos": True})
    assert default["usage"]["completion_tokens"] == 16  # SGLang's default max_tokens


def _lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval 0.4's `LocalCompletionsAPI.parse_logprobs` computes from one choice."""
    logprobs = choice["logprobs"]
    tokens_logprobs = logprobs["token_logprobs"][ctxlen:-1]
    tops = logprobs["top_logprobs"][ctxlen:-1]
    return sum(tokens_logprobs), all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, tops, strict=True))


def test_echo_logprobs_give_lm_eval_its_loglikelihood(qwen: TestClient, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    context, continuation = [1, 261, 13, 25], [40, 41]
    prompts = [context + continuation, [*context, 7]]
    body = {"prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}
    out = post(qwen, "/v1/completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    first = out["choices"][0]["logprobs"]
    assert len(first["token_logprobs"]) == len(prompts[0]) + 1  # the prompt, then the one output token
    assert first["token_logprobs"][0] is None and first["top_logprobs"][0] is None
    assert first["text_offset"] == [-1] * (len(prompts[0]) + 1)
    scored = {"input_ids": prompts[0], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1}
    native = post(qwen, "/generate", {**scored, "sampling_params": {"max_new_tokens": 0}})["meta_info"]
    expected = sum(t[0] for t in native["input_token_logprobs"][len(context):])
    expected_greedy = all(
        row[0][1] == tok for row, tok in zip(native["input_top_logprobs"][len(context):], continuation, strict=True)
    )
    total, greedy = _lm_eval_loglikelihood(out["choices"][0], len(context))
    assert (total, greedy) == (pytest.approx(expected, abs=1e-5), expected_greedy)
    zero = post(qwen, "/v1/completions", {**body, "prompt": prompts[0], "max_tokens": 0})
    assert zero["choices"][0]["logprobs"]["token_logprobs"] == first["token_logprobs"][:-1]
    echoed = AutoTokenizer.from_pretrained(model_dir).decode(prompts[0], skip_special_tokens=True)
    assert zero["choices"][0]["text"] == echoed and out["choices"][0]["text"].startswith(echoed)


def test_completions_n_counts_the_prompt_once(qwen: TestClient) -> None:
    out = post(qwen, "/v1/completions", {"prompt": [1, 5, 6], "max_tokens": 2, "n": 2, "ignore_eos": True})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["prompt_tokens"] == 3 and out["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/chat/completions", {"messages": ASK, "stream": True}, "stream: streaming is not supported"),
        ("/v1/chat/completions", {"messages": []}, "messages: List should have at least 1 item"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role: expected a string"),
        ("/v1/completions", {"prompt": []}, "prompt: Prompt cannot be empty"),
        ("/v1/completions", {"prompt": [1, 99999]}, "input_ids: token id 99999 outside the vocabulary"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "sampling_params.temperature"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs: Input should be greater than or equal to 0"),
    ],
)
def test_bad_v1_bodies_are_sglang_error_responses(qwen: TestClient, path: str, body: dict, needle: str) -> None:
    err = post(qwen, path, body, status=400)
    assert set(err) == {"object", "message", "type", "param", "code"}
    assert (err["object"], err["type"], err["param"], err["code"]) == ("error", "BadRequestError", None, 400)
    assert needle in err["message"]


def test_v1_routes_need_the_api_key(model_dir: Path) -> None:
    with TestClient(create_app(EngineArgs(model_path=str(model_dir), port=1, api_key="user"))) as c:
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": ASK, "max_tokens": 1})):
            assert c.post(path, json=body).status_code == 401
            assert c.post(path, json=body, headers={"Authorization": "Bearer user"}).status_code == 200


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not JSON"),
        ('{"a": 1}', "expected a JSON list of rules, got dict"),
        ('[{"prompt_contains": "x", "completion": "y"}, {"completion": "y"}]',
         "entry 1.prompt_contains: Field required"),
        ('[{"prompt_contains": "", "completion": "y"}]', "entry 0.prompt_contains: String should have at least 1"),
        ('[{"prompt_contains": "x", "completion": "y", "extra": 1}]', "entry 0.extra: Extra inputs are not permitted"),
    ],
)
def test_bad_rules_files_are_refused_naming_the_entry(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "rules.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ScriptError, match=re.escape(needle)):
        load_rules(path)


def test_the_engine_cli_refuses_a_bad_rules_file_with_exit_2(tmp_path: Path, model_dir: Path) -> None:
    bad = tmp_path / "rules.json"
    bad.write_text('{"a": 1}', encoding="utf-8")
    cmd = [sys.executable, "-m", "engine", "--model-path", str(model_dir), "--port", "1",
           "--scripted-completions", str(bad)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "expected a JSON list of rules" in done.stderr and "Traceback" not in done.stderr
    parser = subprocess.run([*cmd[:7], "--tool-call-parser", "llama3"], capture_output=True, text=True, timeout=120)
    assert parser.returncode == 2 and "tool_call_parser: Input should be 'qwen25' or 'hermes'" in parser.stderr


def test_chat_content_parts_template_kwargs_and_default_length(qwen: TestClient, model_dir: Path) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    joined = [{"role": "user", "content": "What is 2+2?"}]
    out = chat(qwen, messages=parts, max_tokens=1)
    assert out["usage"]["prompt_tokens"] == rendered_len(model_dir, joined, None)
    thinking = chat(qwen, messages=joined, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert thinking["usage"]["prompt_tokens"] > out["usage"]["prompt_tokens"]  # the template took the kwarg
    unset = post(qwen, "/v1/chat/completions", {"messages": joined, "ignore_eos": True})
    assert unset["usage"]["completion_tokens"] == 128  # SGLang's max_new_tokens default


def test_token_id_extensions_of_both_routes(qwen: TestClient, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    # a pre-computed prompt skips the template (here: the same prompt, so the same scripted call)
    out = chat(qwen, messages=[{"role": "user", "content": "ignored"}], input_ids=ids, tools=TOOLS,
               return_token_ids=True)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["prompt_token_ids"] == ids
    assert tok.decode(choice["response_token_ids"]) == QWEN_CALL + "</s>"
    only_prompt = chat(qwen, messages=ASK, max_tokens=1, return_prompt_token_ids=True)["choices"][0]
    assert "response_token_ids" not in only_prompt and len(only_prompt["prompt_token_ids"]) == rendered_len(
        model_dir, ASK, None
    )
    cmpl = post(qwen, "/v1/completions", {"prompt": [1, 5, 6], "max_tokens": 2, "return_token_ids": True})
    assert cmpl["choices"][0]["prompt_token_ids"] == [1, 5, 6] and len(cmpl["choices"][0]["token_ids"]) == 2
    plain = post(qwen, "/v1/completions", {"prompt": [1, 5, 6], "max_tokens": 1})["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_the_documented_multi_turn_script_is_a_valid_rules_file(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text(encoding="utf-8")
    block = doc.split("```json\n", 1)[1].split("```", 1)[0]
    (tmp_path / "rules.json").write_text(block, encoding="utf-8")
    rules = load_rules(tmp_path / "rules.json")
    assert [r.prompt_contains for r in rules] == ["<tool_response>", "What is 2+2?"]
    assert rules[1].completion.startswith("<tool_call>\n{") and rules[1].completion.endswith("}\n</tool_call>")
