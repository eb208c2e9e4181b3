"""Chat templates and remote rewards in real eval points: a tiny model whose tokenizer carries a
ChatML (Jinja) template, one CPU engine behind sglang-router, a recording proxy in front of the
router (fleet posture) or the engine (external posture), and a scoring service on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import get_client
from transformers import AutoTokenizer

from blocks import ExternalBackendBlock, FleetBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.points import Posture
from pinned_eval.sinks import JsonlSink
from pinned_eval.suite import DatasetSpec, EvalSuite, RemoteRewardConfig, SamplingDefaults
from tests.pointkit import CpuFleet, PointEnv, save_point_blocks, write_step_snapshot
from tests.reliability.netfaults import FaultyHTTPProxy, ScriptedServer

pytestmark = pytest.mark.e2e

ROWS = [
    {"messages": [{"role": "user", "content": "2+3="}], "label": "5", "extra_info": {"level": "easy"}},
    {
        "messages": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "4+4="}],
        "label": "8",
        "extra_info": {"level": "hard"},
    },
    {"messages": [{"role": "user", "content": "7+1="}], "label": "8", "extra_info": {"level": "easy"}},
]
# what the ChatML template must render (hand-written, not computed by the code under test)
EXPECTED = [
    "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n4+4=<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n7+1=<|im_end|>\n<|im_start|>assistant\n",
]
NO_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def chatml_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("chatml") / "model", chat_template="chatml")


@pytest.fixture(scope="module")
def chatml_fleet(chatml_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpuFleet]:
    from pinned_eval.fleet.launcher import launch_cpu_fleet

    state = tmp_path_factory.mktemp("chatml-fleet") / "fleet.json"
    fleet = launch_cpu_fleet(chatml_model, 1, state_file=state, ready_timeout_s=180)
    try:
        yield CpuFleet.of(fleet)
    finally:
        fleet.stop()


@pytest.fixture
def recorded(chatml_fleet: CpuFleet) -> Iterator[tuple[FaultyHTTPProxy, list[dict]]]:
    """A pass-through proxy in front of the router that keeps every /generate answer."""
    answers: list[dict] = []
    lock = threading.Lock()

    def keep(method: str, path: str, body: bytes) -> bytes:
        if path.startswith("/generate"):
            with lock:
                answers.append(json.loads(body))
        return body

    proxy = FaultyHTTPProxy(chatml_fleet.router_url, rewrite=keep)
    try:
        yield proxy, answers
    finally:
        proxy.close()


@pytest.fixture
def judge() -> Iterator[tuple[ScriptedServer, list[dict]]]:
    """A scoring service: 1.0 for rows whose metadata says level 'easy', 0.0 otherwise."""
    payloads: list[dict] = []

    def score(body: bytes) -> tuple[int, dict[str, str], bytes]:
        sample = json.loads(body)
        payloads.append(sample)
        reward = float(sample["metadata"]["level"] == "easy")
        return 200, {"Content-Type": "application/json"}, json.dumps(reward).encode()

    server = ScriptedServer({("POST", "/score"): score})
    try:
        yield server, payloads
    finally:
        server.close()


def _suite(data: Path, judge_url: str, *, max_attempts: int = 3) -> EvalSuite:
    chat = {"path": str(data), "input_key": "messages", "metadata_key": "extra_info"}
    no_think = {"enable_thinking": False}
    return EvalSuite(
        datasets=(
            DatasetSpec(name="chat", reward="exact_match", **chat),  # type: ignore[arg-type]
            DatasetSpec(name="judged", reward="remote_rm", apply_chat_template_kwargs=no_think, **chat),  # type: ignore[arg-type]
        ),
        defaults=SamplingDefaults(
            apply_chat_template=True, system_prompt="Be terse.", temperature=0.0, max_new_tokens=3
        ),
        remote_reward=RemoteRewardConfig(url=judge_url, max_attempts=max_attempts, backoff_s=0),
    )


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _env(tmp_path: Path, fleet: CpuFleet, router_url: str, suite: EvalSuite, name: str) -> PointEnv:
    block = FleetBlock(name=name, mode="attach", engine_urls=fleet.engine_urls, router_url=router_url,
                       **fleet.block_keys())
    return save_point_blocks(tmp_path, block, suite=suite, keep_snapshots=0)


def _staged(env: PointEnv, step: int, base: Path) -> dict[str, str]:
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)
    write_step_snapshot(base, dest)
    return {"kind": "staged", "path": dest}


def _run(env: PointEnv, step: int, **params: object):
    state = eval_point(**env.params(step, **params), return_state=True)
    with get_client(sync_client=True) as c:
        c.read_flow_run(state.state_details.flow_run_id)
    return state


def _eval_requests(proxy: FaultyHTTPProxy, run: str) -> list[dict]:
    """The point's /generate bodies (not the pin's readiness probes), as the proxy passed them on."""
    bodies = [json.loads(s.body) for s in proxy.seen("pass", "/generate")]
    return [b for b in bodies if str(b.get("rid", "")).startswith(f"{run}-")]


def _sent(proxy: FaultyHTTPProxy, run: str, tokenizer) -> dict[str, str]:
    """rid -> the prompt text the router (and its engine) received, decoded from the input_ids."""
    out = {}
    for body in _eval_requests(proxy, run):
        assert "text" not in body, "templated prompts travel as input_ids (no second BOS)"
        out[body["rid"]] = tokenizer.decode(body["input_ids"], skip_special_tokens=False)
    return out


def test_fleet_point_sends_the_snapshots_chat_template_and_scores_remotely(
    prefect_server: str, chatml_fleet: CpuFleet, chatml_model: Path, recorded, judge, tmp_path: Path
) -> None:
    proxy, answers = recorded
    server, payloads = judge
    env = _env(tmp_path, chatml_fleet, proxy.url, _suite(_data(tmp_path), f"{server.url}/score"), "chatfleet")
    src = _staged(env, 21, chatml_model)
    state = _run(env, 21, source=src)
    assert state.is_completed() and state.name == "Completed", state.message

    sent = _sent(proxy, env.run, AutoTokenizer.from_pretrained(chatml_model))  # the snapshot's tokenizer is a copy
    assert sent == {
        **{f"{env.run}-21-chat-{i}-0": text for i, text in enumerate(EXPECTED)},
        **{f"{env.run}-21-judged-{i}-0": text + NO_THINK for i, text in enumerate(EXPECTED)},
    }
    sent_ids = {b["rid"]: b["input_ids"] for b in _eval_requests(proxy, env.run)}
    # the engine counted exactly the tokens that were sent: it tokenized nothing itself
    counted = {a["meta_info"]["id"]: a["meta_info"]["prompt_tokens"] for a in answers}
    assert {rid: counted[rid] for rid in sent_ids} == {rid: len(ids) for rid, ids in sent_ids.items()}
    # the scoring service got the rendered prompt, the label and the row's metadata
    assert sorted((p["prompt"], p["label"], p["metadata"]["level"]) for p in payloads) == sorted(
        (text + NO_THINK, row["label"], row["extra_info"]["level"]) for text, row in zip(EXPECTED, ROWS, strict=True)
    )
    rows = JsonlSink(env.jsonl).read(env.run)
    assert sorted((r.dataset, r.step, r.state, r.weight_version) for r in rows) == [
        ("chat", 21, "measured", "21"),
        ("judged", 21, "measured", "21"),
    ]
    judged = next(r for r in rows if r.dataset == "judged")
    assert judged.metrics["eval/judged"] == pytest.approx(2 / 3)
    assert not Path(src["path"]).exists(), "the snapshot is retired"


def test_template_that_fails_to_render_fails_the_point_naming_the_dataset(
    prefect_server: str, chatml_fleet: CpuFleet, chatml_model: Path, recorded, judge, tmp_path: Path
) -> None:
    proxy, _ = recorded
    server, _ = judge
    base = Path(shutil.copytree(chatml_model, tmp_path / "broken-base"))
    (base / "chat_template.jinja").write_text("{{ raise_exception('system messages are not supported') }}")
    env = _env(tmp_path, chatml_fleet, proxy.url, _suite(_data(tmp_path), f"{server.url}/score"), "chatbroken")
    src = _staged(env, 22, base)
    state = _run(env, 22, source=src)
    assert state.is_failed()
    assert "dataset 'chat' row 0: the chat template failed to render" in state.message
    assert "system messages are not supported" in state.message
    assert not _eval_requests(proxy, env.run), "nothing is generated from an unrendered prompt"
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert (row.step, row.state, row.metrics["eval/skipped_crashed"]) == (22, "failed", 1)
    assert not Path(src["path"]).exists(), "the snapshot is retired"


def test_scoring_service_that_always_fails_skips_the_point(
    prefect_server: str, chatml_fleet: CpuFleet, chatml_model: Path, recorded, tmp_path: Path
) -> None:
    proxy, _ = recorded
    broken = ScriptedServer({("POST", "/score"): lambda body: (500, {}, b"down")})
    try:
        suite = _suite(_data(tmp_path), f"{broken.url}/score", max_attempts=2)
        env = _env(tmp_path, chatml_fleet, proxy.url, suite, "chatjudge")
        src = _staged(env, 23, chatml_model)
        state = _run(env, 23, source=src)
    finally:
        broken.close()
    assert state.name == "Skipped" and state.message.startswith("reward_unavailable"), state.message
    assert "dataset 'judged'" in state.message and "no answer after 2 attempt(s): HTTP 500" in state.message
    assert len(broken.requests) == 2 * len(ROWS)
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert (row.step, row.state, row.metrics["eval/skipped_reward_unavailable"]) == (23, "skipped", 1)
    assert not Path(src["path"]).exists(), "the snapshot is retired"


def test_external_posture_backend_sends_the_same_rendered_prompts(
    prefect_server: str, chatml_fleet: CpuFleet, chatml_model: Path, judge, tmp_path: Path
) -> None:
    server, payloads = judge
    [engine] = chatml_fleet.engine_urls
    proxy = FaultyHTTPProxy(engine)
    try:
        suite = _suite(_data(tmp_path), f"{server.url}/score")
        env = _env(tmp_path, chatml_fleet, chatml_fleet.router_url, suite, "chatext")
        src = _staged(env, 24, chatml_model)
        backend = f"chatext-{uuid.uuid4().hex[:8]}"  # the operator's saved backend; the point names it
        ExternalBackendBlock(
            backend="trainer_integration.sglang_backend:SGLangCheckpointEval",
            options={"url": proxy.url},
            secret_options={"api_key": chatml_fleet.api_key, "admin_api_key": chatml_fleet.admin_api_key},
        ).save(backend)
        state = _run(env, 24, source=src, posture=Posture.EXTERNAL, backend_block=backend)
        sent = _sent(proxy, env.run, AutoTokenizer.from_pretrained(chatml_model))
    finally:
        proxy.close()
    assert state.is_completed() and state.name == "Completed", state.message
    assert sorted(sent.values()) == sorted([*EXPECTED, *(t + NO_THINK for t in EXPECTED)])
    assert len(payloads) == len(ROWS)
    rows = JsonlSink(env.jsonl).read(env.run)
    assert sorted((r.dataset, r.step, r.state) for r in rows) == [("chat", 24, "measured"), ("judged", 24, "measured")]
    assert next(r for r in rows if r.dataset == "judged").metrics["eval/judged"] == pytest.approx(2 / 3)
    assert not Path(src["path"]).exists(), "the snapshot is retired"
