"""Bad input at every edge is refused with an error that names the field, and nothing is left
half-created: block fields, flow parameters, eval dataset rows, reward outputs, engine responses
(a scripted misbehaving engine and router: non-JSON, not an object, missing fields, wrong types,
huge bodies). Event payloads and trigger parameters are property-tested in
test_input_properties.py.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.exceptions import ObjectNotFound
from pydantic import ValidationError
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.fleet.client import FleetClient, FleetConfig
from pinned_eval.fleet.errors import EngineHTTPError, GenerateRejected, PinViolation
from pinned_eval.points import inflight_limit_name
from pinned_eval.sinks import JsonlSink
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults
from tests.pointkit import SMALL_SUITE, CpuFleet, PointEnv, save_point_blocks, write_step_snapshot
from tests.prefect_server import prefect_rest_client
from tests.reliability.netfaults import Responder, ScriptedServer

JSON = {"Content-Type": "application/json"}


def ok(body: object) -> Responder:
    data = json.dumps(body).encode()
    return lambda _: (200, JSON, data)


def raw(data: bytes) -> Responder:
    return lambda _: (200, {"Content-Type": "text/html"}, data)


# ---- block fields ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: FleetBlock(name="Bad Name", mode="attach", engine_urls=["http://127.0.0.1:1"],
                            router_url="http://127.0.0.1:1"), "name"),
        (lambda: FleetBlock(mode="attach"), "engine_urls"),
        (lambda: FleetBlock(mode="launch"), "state_file"),
        (lambda: FleetBlock(mode="launch", state_file="/x", request_concurrency=0), "request_concurrency"),
        (lambda: FleetBlock(mode="launch", state_file="/x", load_timeout_s=-1), "load_timeout_s"),
        (lambda: StagingBlock(root="/s", keep_snapshots=-1), "keep_snapshots"),
        (lambda: SinksBlock(wandb_mode="sometimes"), "wandb_mode"),
        (lambda: SinksBlock(wandb_writer="shared", wandb_mode="offline"), "wandb_writer"),
        (lambda: SinksBlock(wandb_writer="resume"), "wandb_writer"),
        (lambda: EvalSuiteBlock(suite={"datasets": [{"name": "a", "path": "a.jsonl"}]}, point_timeout_seconds=0),
         "point_timeout_seconds"),
        (lambda: EvalSuiteBlock(suite={"datasets": [{"name": "a", "path": "a.jsonl", "reward": "vibes"}]}), "reward"),
    ],
)
def test_block_fields_are_refused_by_name(make, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError) as info:
        make()
    assert field in str(info.value)


def _busy(exc: BaseException) -> bool:  # SQLite-backed server under load answers 503: try again
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 503


@retry(retry=retry_if_exception(_busy), wait=wait_exponential(0.2, max=3), stop=stop_after_attempt(10), reraise=True)
def _edit_block(api: str, name: str, slug: str, data: dict) -> None:
    """What an operator's edit in the UI does: replace the document's data over REST (unvalidated)."""
    with prefect_rest_client(api) as c:
        doc = c.get(f"/block_types/slug/{slug}/block_documents/name/{name}").raise_for_status().json()
        c.patch(f"/block_documents/{doc['id']}", json={"data": {**doc["data"], **data}, "merge_existing_data": False}
                ).raise_for_status()


def _edited_point(api: str, tmp_path: Path, tiny_model: Path):  # type: ignore[no-untyped-def]
    fleet = FleetBlock(name="edited", mode="attach", engine_urls=["http://127.0.0.1:9"], router_url="http://127.0.0.1:9")
    env = save_point_blocks(tmp_path, fleet)
    _edit_block(api, env.blocks["fleet"], "pinned-eval-fleet", {"request_concurrency": 0})
    state = eval_point(**env.params(1, source={"kind": "state_dict", "path": str(tmp_path / "w.safetensors"),
                                               "hf_base": str(tiny_model)}), return_state=True)
    return env, state


@pytest.mark.e2e
def test_saved_block_edited_into_a_bad_value_fails_the_point_before_anything_is_created(
    prefect_server: str, tmp_path: Path, tiny_model: Path
) -> None:
    env, state = _edited_point(prefect_server, tmp_path, tiny_model)
    assert state.is_failed() and env.blocks["fleet"] in state.message, state.message
    _nothing_created(env)


@pytest.mark.e2e
def test_saved_block_edited_into_a_bad_value_names_the_field(prefect_server: str, tmp_path: Path,
                                                             tiny_model: Path) -> None:
    _, state = _edited_point(prefect_server, tmp_path, tiny_model)
    assert "request_concurrency" in state.message, state.message


def _nothing_created(env: PointEnv) -> None:
    assert list(env.staging_root.iterdir()) == [], "no snapshot was exported"
    with get_client(sync_client=True) as c, pytest.raises(ObjectNotFound):
        c.read_global_concurrency_limit_by_name(inflight_limit_name(env.run))


# ---- flow parameters -------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"step": -3, "source": {"kind": "hf", "path": "/x"}}, "step"),
        ({"step": 1, "source": None}, "source"),
        ({"step": 1, "source": {"kind": "state_dict", "path": "/x"}}, "hf_base"),
        ({"step": 1, "source": {"kind": "hf", "path": "/x"}, "posture": "external"}, "backend_block"),
        ({"step": "one", "source": {"kind": "hf", "path": "/x"}}, "step"),
    ],
)
def test_bad_flow_parameters_fail_the_run_naming_the_field(
    prefect_server: str, tmp_path: Path, params: dict, field: str
) -> None:
    fleet = FleetBlock(name="params", mode="attach", engine_urls=["http://127.0.0.1:9"], router_url="http://127.0.0.1:9")
    env = save_point_blocks(tmp_path, fleet)
    state = eval_point(**env.params(**params), return_state=True)  # type: ignore[arg-type]
    assert state.is_failed() and field in state.message, state.message
    _nothing_created(env)


# ---- eval dataset rows and reward outputs (a real point on the CPU fleet) ----------------------------


def _suite(tmp_path: Path, rows: list[object], reward: str = "exact_match") -> EvalSuite:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return EvalSuite(datasets=(DatasetSpec(name="rows", path=str(path)),),
                     defaults=SamplingDefaults(temperature=0.0, max_new_tokens=2, reward=reward))


def _staged(env: PointEnv, step: int, tiny: Path) -> str:
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)
    return write_step_snapshot(tiny, dest)


@pytest.mark.e2e
def test_bad_dataset_row_fails_the_point_naming_file_line_and_key(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path
) -> None:
    suite = _suite(tmp_path, [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"},
                              {"prompt": "3+3=", "label": ["6"]}])
    fleet = FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, suite=suite, keep_snapshots=0)
    dest = _staged(env, 7, tiny_model)
    state = eval_point(**env.params(7, source={"kind": "staged", "path": dest}), return_state=True)
    assert state.is_failed(), state
    assert "rows.jsonl: line 3: key 'label'" in state.message, state.message
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert row.metrics["eval/skipped_crashed"] == 1
    assert not Path(dest).exists(), "the point's snapshot is retired"


@pytest.mark.e2e
def test_bad_dataset_row_is_refused_before_any_export(prefect_server: str, tmp_path: Path, tiny_model: Path) -> None:
    """Rows are read first (flows/eval_point.py: `load_datasets` before `export_snapshot`): a bad
    row fails the point with no export task run and nothing written under staging, although the
    source (the tiny model's own weights as a state dict) would export."""
    suite = _suite(tmp_path, [{"prompt": "1+1=", "label": {"no": 1}}])
    fleet = FleetBlock(name="early", mode="attach", engine_urls=["http://127.0.0.1:9"], router_url="http://127.0.0.1:9")
    env = save_point_blocks(tmp_path, fleet, suite=suite, keep_snapshots=5)
    [weights] = sorted(tiny_model.glob("*.safetensors"))
    state = eval_point(**env.params(8, source={"kind": "state_dict", "path": str(weights),
                                               "hf_base": str(tiny_model)}), return_state=True)
    assert state.is_failed() and "rows.jsonl: line 1" in state.message, state.message
    with get_client(sync_client=True) as c:
        run_id = FlowRunFilterId(any_=[state.state_details.flow_run_id])
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=run_id))
    assert [r.name for r in runs if r.name.startswith(("export", "check"))] == []
    assert list(env.staging_root.iterdir()) == [], "no snapshot was exported"


@pytest.mark.e2e
@pytest.mark.parametrize("reward", ["says_yes", "not_a_number"])
def test_reward_output_that_is_not_a_number_fails_the_point_naming_the_reward(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path, reward: str
) -> None:
    name = f"custom:tests.reliability.rewards:{reward}"
    suite = SMALL_SUITE.model_copy(update={"defaults": SMALL_SUITE.defaults.model_copy(update={"reward": name})})
    fleet = FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, suite=suite, keep_snapshots=0)
    dest = _staged(env, 9, tiny_model)
    state = eval_point(**env.params(9, source={"kind": "staged", "path": dest}), return_state=True)
    assert state.is_failed() and "RewardTypeError" in state.message and reward in state.message, state.message
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert row.state == "failed" and row.metrics["eval/skipped_crashed"] == 1
    assert not Path(dest).exists()


# ---- engine and router responses -------------------------------------------------------------------

HUGE = 3 * 1024 * 1024

MODEL_INFO = {
    "not JSON": (raw(b"<html>502 Bad Gateway</html>"), "not JSON"),
    "not an object": (ok(["7", "/snap"]), "not a JSON object"),
    "missing model_path": (ok({"weight_version": "7"}), "model_path: Field required"),
    "wrong type": (ok({"weight_version": {"v": 7}, "model_path": "/snap"}), "weight_version: Input should be"),
    "huge": (ok({"weight_version": "7", "model_path": "x" * HUGE}), "reads back model_path"),
}


@pytest.mark.parametrize("case", sorted(MODEL_INFO))
async def test_malformed_model_info_is_a_pin_violation_naming_the_field(case: str) -> None:
    reply, expected = MODEL_INFO[case]
    engine = ScriptedServer({
        ("GET", "/health"): lambda _: (200, {}, b""),
        ("POST", "/update_weights_from_disk"): ok({"success": True, "message": "ok", "num_paused_requests": 0}),
        ("GET", "/model_info"): reply,
    })
    router = ScriptedServer({("GET", "/workers"): ok({"workers": []})})
    try:
        async with FleetClient([engine.url], router.url, config=FleetConfig(poll_interval_s=0.1)) as client:
            with pytest.raises(PinViolation) as info:
                await client.pin("/snap", "7")
    finally:
        engine.close()
        router.close()
    message = str(info.value)
    assert expected in message and engine.url in message, message[:2000]
    assert len(message) < 10_000, "a huge reply is cut, not copied into the skip message"
    assert ("POST", "/workers") not in router.requests, "an unverified engine never joins the router"


GENERATE = {
    "not JSON": (raw(b"x" * HUGE), "not JSON"),
    "a list": (ok([{"text": "a"}]), "expected one result object"),
    "missing meta_info": (ok({"text": "4"}), "meta_info: Field required"),
    "missing text": (ok({"meta_info": {"weight_version": "7"}}), "text: Field required"),
    "wrong types": (ok({"text": "4", "meta_info": {"completion_tokens": "many", "weight_version": "7"}}),
                    "meta_info.completion_tokens"),
    "bad finish reason": (ok({"text": "4", "meta_info": {"finish_reason": {"type": "exploded"}}}),
                          "meta_info.finish_reason.type"),
}


@pytest.mark.parametrize("case", sorted(GENERATE))
async def test_malformed_generate_reply_is_refused_naming_the_field(case: str) -> None:
    reply, expected = GENERATE[case]
    router = ScriptedServer({("POST", "/generate"): reply})
    try:
        async with FleetClient(["http://127.0.0.1:9"], router.url) as client:
            with pytest.raises(GenerateRejected) as info:
                await client.generate("1+1=", sampling_params={"max_new_tokens": 1}, expected_version="7")
    finally:
        router.close()
    assert expected in str(info.value) and len(str(info.value)) < 2_000, str(info.value)[:2000]


def test_engine_http_error_keeps_the_whole_body_but_shows_a_cut() -> None:
    err = EngineHTTPError("http://127.0.0.1:1", 500, "y" * HUGE)
    assert len(err.body) == HUGE and len(str(err)) < 1_000
