"""miles generate functions, unchanged, through the `function` rollout: a CPU engine (scripted
decoding, weight version 5) behind the real sglang-router, the point gateway in front, user code in
the runner subprocess with pinned-eval's miles-compatible surface.

Fixtures in the shape of miles' examples (tests/fixtures/miles_style/): search-r1 (old form, `text`
+ `return_logprob`, a retriever stub on 127.0.0.1, a custom `reward_func`), multi-agent (old form
with `evaluation=`, `list[Sample]`, a reward set during generation), the generate hub's
`single_turn` (new form, `input_ids` from the pinned snapshot's tokenizer), an agent function over
chat completions (`agentic_tool_call`, its own gateway session). A point whose gateway
sees another version is `pin_violation`; endless turns are stopped by the per-sample turn limit and
skip the point `agent_error`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.fleet.cpu_engine import CpuEngineArgs, engine_spec
from pinned_eval.fleet.errors import WeightVersionMismatch
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.fleet.keys import FleetKeys
from pinned_eval.fleet.launcher import LaunchedFleet, launch_fleet
from pinned_eval.gateway import GatewayLimits
from pinned_eval.rollout import PointSession, Sample
from pinned_eval.rollout.function import FunctionRollout
from pinned_eval.skips import EvalSkipped
from pinned_eval.suite import DatasetSpec, EvalSuite
from tests.conftest import free_port

pytestmark = pytest.mark.e2e
FIXTURES = str(Path(__file__).parent.parent / "fixtures" / "miles_style")
# miles' own eval (`generate_and_rm`, evaluation=True, miles 31f1ca9) on these fixtures against this
# same scripted engine and retriever stub: scripts/record_miles_generate_goldens.py, docs/agentic.md
GOLDEN = Path(__file__).parent.parent / "data" / "miles_generate_golden.jsonl"


def golden(fixture: str) -> list[dict]:
    return [g for line in GOLDEN.read_text().splitlines() if (g := json.loads(line))["fixture"] == fixture]


def as_golden(samples: list[Sample]) -> list[dict]:
    """pinned-eval's samples in the golden's terms (response, status, reward, weight versions)."""
    return [{"response": s.response, "status": s.status, "reward_value": s.reward,
             "weight_versions": [s.weight_version] if s.weight_version else []} for s in samples]
CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(2+2)"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "code_interpreter", "parameters": {"type": "object"}}}]
RULES = [
    {"prompt_contains": "Output:\n4", "completion": "The answer is 4."},
    {"prompt_contains": "<tool_response>", "completion": "The answer is 4."},
    {"prompt_contains": "What is 2+2?", "completion": CALL},
    {"prompt_contains": "<information>", "completion": "<answer>Paris</answer>"},
    {"prompt_contains": "Capital of France?", "completion": "<search>capital of France</search>"},
    {"prompt_contains": "[rewriter]", "completion": "rewritten 7"},
    {"prompt_contains": "[solver]", "completion": "\\boxed{7}"},
    {"prompt_contains": "loop forever", "completion": "again"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("fn") / "m", arch="llama", seed=0, chat_template="chatml")


@pytest.fixture(scope="module")
def fleet(model: Path) -> Iterator[LaunchedFleet]:
    rules = model.parent / "rules.json"
    rules.write_text(json.dumps(RULES))
    keys = FleetKeys.resolve()
    spec = engine_spec(
        CpuEngineArgs(model_path=str(model), port=free_port(), weight_version="5", api_key=keys.api,
                      admin_api_key=keys.admin, scripted_completions=str(rules), tool_call_parser="qwen25"),
        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    launched = launch_fleet([spec], log_dir=model.parent / "logs", keys=keys, ready_timeout_s=120)
    try:
        yield launched
    finally:
        launched.stop()


@pytest.fixture(scope="module")
def retriever() -> Iterator[list[dict]]:
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append(body)
            docs = [{"document": {"contents": "Paris is the capital of France."}}]
            out = json.dumps({"result": [docs[: body["topk"]]]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RETRIEVER_URL", f"http://127.0.0.1:{server.server_port}/retrieve")
        yield seen
    server.shutdown()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


def _ds(name: str, function: str, reward: str, max_new_tokens: int = 48, **kw: object):  # type: ignore[no-untyped-def]
    spec = DatasetSpec(name=name, path=f"/{name}.jsonl", generate_function=function, reward=reward,
                       temperature=0.0, max_new_tokens=max_new_tokens, **kw)  # type: ignore[arg-type]
    [ds] = EvalSuite(datasets=(spec,)).resolved()
    return ds


async def _point(fleet: LaunchedFleet, http: httpx.AsyncClient, model: Path, ds, rows, *,  # type: ignore[no-untyped-def]
                 version: str = "5", limits: GatewayLimits | None = None) -> list[Sample]:
    assert fleet.router_url is not None and fleet.keys is not None
    gen = RouterGenerator(http, fleet.router_url, api_key=fleet.keys.api)
    session = PointSession(gen, expected_version=version, rid_prefix=f"p{version}", tokenizer_dir=str(model))
    out: list[Sample] = []
    async with FunctionRollout(limits, python_path=[FIXTURES], sample_timeout_s=120).open(
        session, [ds], {ds.name: rows}
    ) as produce:
        for row in rows:
            got = await produce(ds, row, 0)
            out.extend(got if isinstance(got, list) else [got])
    return out


async def test_search_r1_style_function_with_retriever_and_custom_reward(
    fleet: LaunchedFleet, http: httpx.AsyncClient, model: Path, retriever: list[dict]
) -> None:
    [g] = golden("search_r1_style.generate")
    ds = _ds("search", g["fixture"], g["reward"], max_new_tokens=g["max_new_tokens"])
    [s] = await _point(fleet, http, model, ds, [EvalSample(0, g["prompt"], g["label"])])
    [want] = g["samples"]
    assert (s.response, s.status, s.reward) == (want["response"], want["status"], want["reward_value"])
    assert want["weight_versions"] == ["5", "5"] and (s.finish_reason, s.weight_version) == ("stop", "5")
    assert s.turns == 0  # no routing key sent: the calls are the point's, not a sample's
    assert retriever[-1] == {"queries": ["capital of France"], "topk": 2}


async def test_multi_agent_list_of_samples_keeps_rewards_set_during_generation(
    fleet: LaunchedFleet, http: httpx.AsyncClient, model: Path
) -> None:
    [g] = golden("multi_agent_style.generate_with_multi_agents")
    ds = _ds("multi", g["fixture"], g["reward"], max_new_tokens=g["max_new_tokens"])
    samples = await _point(fleet, http, model, ds, [EvalSample(0, g["prompt"], g["label"])])
    assert as_golden(samples) == g["samples"]  # miles' own: the solver rewarded in generation, the rewriter by math
    solver, rewriter = samples
    assert (solver.metadata["agent"], rewriter.metadata["agent"]) == ("solver", "rewriter")
    assert [(s.prompt_index, s.sample_index, s.finish_reason) for s in samples] == [(0, 0, "stop"), (0, 0, "stop")]


async def test_generate_hub_single_turn_new_form(fleet: LaunchedFleet, http: httpx.AsyncClient, model: Path) -> None:
    [g] = golden("miles.rollout.generate_hub.single_turn.generate")
    ds = _ds("hub", g["fixture"], g["reward"], max_new_tokens=g["max_new_tokens"])
    [s] = await _point(fleet, http, model, ds, [EvalSample(0, g["prompt"], g["label"])])
    assert as_golden([s]) == g["samples"]  # miles' own: the EOS text kept (skip_special_tokens False)
    assert s.turns == 1 and s.response_len > 0  # routing key = the gateway's sample key; token ids from logprobs


async def test_another_version_is_pin_violation(fleet: LaunchedFleet, http: httpx.AsyncClient, model: Path) -> None:
    ds = _ds("search", "search_r1_style.generate", "custom:search_r1_style.reward_func")
    with pytest.raises(WeightVersionMismatch, match="'5', expected '6'"):
        await _point(fleet, http, model, ds, [EvalSample(0, "Capital of France?", "Paris")], version="6")


async def test_endless_turns_stop_at_the_turn_limit_as_agent_error(
    fleet: LaunchedFleet, http: httpx.AsyncClient, model: Path
) -> None:
    ds = _ds("loop", "runaway.endless", "exact_match")
    with pytest.raises(EvalSkipped, match=r"^agent_error: dataset 'loop' sample 0 \(j=0\): HTTPStatusError: .*429"):
        await _point(fleet, http, model, ds, [EvalSample(0, "go", "x")], limits=GatewayLimits(max_turns_per_sample=3))


async def test_agent_function_over_chat_completions_in_its_session(
    fleet: LaunchedFleet, http: httpx.AsyncClient, model: Path
) -> None:
    [g] = golden("miles.rollout.generate_hub.agentic_tool_call.generate")
    assert g["metadata"] == {"tools": TOOLS}
    ds = _ds("agent", g["fixture"], g["reward"], max_new_tokens=g["max_new_tokens"],
             custom_agent_function_path=g["miles_args"]["custom_agent_function_path"])
    [s] = await _point(fleet, http, model, ds, [EvalSample(0, g["prompt"], g["label"], g["metadata"])])
    [want] = g["samples"]
    assert (s.status, s.reward) == (want["status"], want["reward_value"])  # miles' own: completed, 1.0
    assert s.messages is not None and [m["weight_version"] for m in s.messages] == want["weight_versions"]
    # miles' response: its session server's merged trajectory (each turn's output with its EOS text,
    # the template's tool turn and the next generation prompt between), rebuilt from the transcript
    assert s.response == want["response"]
    assert want["response"] == CALL + "</s><|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n" \
        "<|im_start|>assistant\nThe answer is 4.</s>"
    assert (s.status, s.finish_reason, s.weight_version, s.reward) == ("completed", "stop", "5", 1.0)
    assert (s.turns, s.metadata["agent_turns"], s.metadata["reward"]) == (2, 4, 1.0)
    assert s.messages is not None
    assert [(m["route"], m["finish_reason"], m["weight_version"]) for m in s.messages] == [
        ("/sessions/{id}/v1/chat/completions", "tool_calls", "5"), ("/sessions/{id}/v1/chat/completions", "stop", "5")]
    assert s.messages[0]["tool_calls"][0]["function"]["name"] == "code_interpreter"


async def test_retool_style_multi_turn_with_tool_specs(
    fleet: LaunchedFleet, http: httpx.AsyncClient, model: Path
) -> None:
    [g] = [x for x in golden("miles.rollout.generate_hub.multi_turn.generate")
           if x["miles_args"]["generate_execute_tool_function_path"] == "retool_style.execute_tool"]
    assert g["miles_args"] == {"generate_max_turns": 3, "generate_tool_specs_path": "retool_style.tool_specs",
                               "generate_tool_call_parser": "qwen25",
                               "generate_execute_tool_function_path": "retool_style.execute_tool"}
    ds = _ds("retool", g["fixture"], g["reward"], max_new_tokens=g["max_new_tokens"], **g["miles_args"])
    [s] = await _point(fleet, http, model, ds, [EvalSample(0, g["prompt"], g["label"])])
    [want] = g["samples"]  # miles' own multi_turn with our fixture's tool: one version per model call
    assert (s.response, s.status, s.reward) == (want["response"], want["status"], want["reward_value"])
    assert want["weight_versions"] == [s.weight_version] * s.turns
    # the template's tool turn between the two outputs, each with its EOS text, as miles keeps them
    assert s.response == CALL + "</s><|im_start|>user\n<tool_response>\nOutput:\n4\n</tool_response><|im_end|>\n" \
        "<|im_start|>assistant\nThe answer is 4.</s>"
    assert (s.status, s.weight_version, s.turns, s.reward) == ("completed", "5", 2, 0)  # math: no \boxed{}
