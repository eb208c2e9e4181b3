"""The CPU engine's SGLang-native HTTP protocol, in process (Starlette TestClient, real model)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from engine.launch import EngineArgs
from engine.protocol import SamplingParams
from engine.server import create_app


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("engine-proto") / "m", arch="llama", seed=0)


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    app = create_app(EngineArgs(model_path=str(model_dir), port=1, weight_version="7"))
    with TestClient(app) as c:
        yield c


def gen(client: TestClient, **body) -> dict | list:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.mark.parametrize(
    ("params", "field"),
    [({"seed": 7}, "seed"), ({"max_tokens": 5}, "max_tokens"), ({"temperature": 0, "best_of": 2}, "best_of")],
)
def test_unknown_sampling_key_is_400_naming_it(client: TestClient, params: dict, field: str) -> None:
    r = client.post("/generate", json={"text": "1+1=", "sampling_params": params})
    assert r.status_code == 400
    assert f"unknown field `{field}`" in r.json()["error"]
    assert "sampling_seed" in r.json()["error"]  # lists the accepted keys


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": "x", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params: 1 entries"),
        ({"text": "x", "input_ids": [1, 2]}, "exactly one of text, input_ids"),
        ({"sampling_params": {}}, "exactly one of text, input_ids"),
        ({"input_ids": [1, 99999]}, "outside the vocabulary"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, "max_new_tokens"),
        ({"text": "x", "stream": True}, "stream"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(client: TestClient, body: dict, needle: str) -> None:
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]


def test_every_sglang_sampling_key_is_accepted(client: TestClient) -> None:
    params = {
        "max_new_tokens": 3, "stop": ["zz"], "stop_token_ids": [2], "stop_regex": "qq+", "temperature": 0.5,
        "top_p": 0.9, "top_k": 20, "min_p": 0.01, "frequency_penalty": 0.1, "presence_penalty": 0.1,
        "repetition_penalty": 1.1, "min_new_tokens": 1, "n": 1, "json_schema": None, "regex": None,
        "ebnf": None, "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True,
        "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": 1,
        "logit_bias": {"5": 0.5}, "sampling_seed": 3, "custom_params": None, "beam_width": None,
        "watermark": None, "choice": None,
    }
    out = gen(client, text="hello", sampling_params=params, some_unknown_top_level_key=1)
    assert isinstance(out, dict) and 1 <= out["meta_info"]["completion_tokens"] <= 3
    # accepted means kept: every implemented key reaches the decoder with the value sent
    parsed = SamplingParams.parse(params)
    kept = {k: v for k, v in params.items() if v is not None and k not in ("stop_regex", "logit_bias")}
    assert parsed.model_dump(include=set(kept)) == kept
    assert (parsed.stop_regex, parsed.logit_bias) == (["qq+"], {5: 0.5})
    # and honoured: the same seed at temperature 0.5 gives the same tokens again
    again = gen(client, text="hello", sampling_params=params)
    assert isinstance(again, dict) and again["output_ids"] == out["output_ids"]


def test_single_response_shape(client: TestClient, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(model_dir)("12+7=").input_ids
    assert prompt_ids[0] == 1  # text prompts get BOS, like SGLang's tokenizer.encode
    out = gen(client, text="12+7=", sampling_params=GREEDY, rid="r1")
    assert isinstance(out, dict)
    meta = out["meta_info"]
    assert meta["id"] == "r1"
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 12
    assert meta["prompt_tokens"] == len(prompt_ids)
    assert meta["cached_tokens"] == 0
    assert meta["weight_version"] == "7"
    assert "weight_versions" not in meta
    assert isinstance(out["text"], str)


def test_batch_shapes_and_n_expansion(client: TestClient) -> None:
    batch = gen(client, text=["1+1=", "hello world"], sampling_params=GREEDY)
    assert isinstance(batch, list) and len(batch) == 2
    ids_batch = gen(
        client, input_ids=[[1, 5, 6], [1, 7]], sampling_params=[GREEDY, {**GREEDY, "max_new_tokens": 3}]
    )
    assert [o["meta_info"]["completion_tokens"] for o in ids_batch] == [12, 3]
    assert [o["meta_info"]["prompt_tokens"] for o in ids_batch] == [3, 2]
    copies = gen(client, text="1+1=", sampling_params={**GREEDY, "n": 3})
    assert isinstance(copies, list) and len(copies) == 3
    assert all(c["output_ids"] == copies[0]["output_ids"] for c in copies)  # greedy copies agree
    both = gen(
        client, input_ids=[[1, 5], [1, 6, 7, 8]], sampling_params={"max_new_tokens": 2, "n": 2}, rid="b"
    )
    assert [o["meta_info"]["prompt_tokens"] for o in both] == [2, 2, 4, 4]  # copies next to their prompt
    assert [o["meta_info"]["id"] for o in both] == ["b_0_0", "b_0_1", "b_1_0", "b_1_1"]


def test_greedy_is_deterministic_and_matches_transformers(client: TestClient, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    first = gen(client, input_ids=[1, 261, 13, 25], sampling_params=GREEDY)
    again = gen(client, input_ids=[[1, 261, 13, 25], [1, 9, 9, 9, 9, 9, 9]], sampling_params=GREEDY)
    assert first["output_ids"] == again[0]["output_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([[1, 261, 13, 25]])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                         do_sample=False, pad_token_id=0)
    assert first["output_ids"] == ref[0, 4:].tolist()


def test_sampling_seed_is_deterministic_per_request(client: TestClient) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
    a = gen(client, text="hello", sampling_params={**params, "sampling_seed": 11})
    b = gen(client, text=["abc", "hello", "9"], sampling_params={**params, "sampling_seed": 11})
    c = gen(client, text="hello", sampling_params={**params, "sampling_seed": 12})
    assert a["output_ids"] == b[1]["output_ids"]
    assert a["output_ids"] != c["output_ids"]
    copies = gen(client, text="hello", sampling_params={**params, "sampling_seed": 11, "n": 2})
    assert copies[0]["output_ids"] == a["output_ids"]  # copy 0 uses the seed itself
    assert copies[1]["output_ids"] != a["output_ids"]


def test_stop_token_ids_and_min_new_tokens(client: TestClient) -> None:
    ref = gen(client, text="12+7=", sampling_params={**GREEDY, "max_new_tokens": 20})["output_ids"]
    stop = ref[3]
    first = ref.index(stop)
    out = gen(
        client, text="12+7=", sampling_params={**GREEDY, "max_new_tokens": 20, "stop_token_ids": [stop]}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ref[: first + 1]  # the matched token is kept in output_ids
    late = gen(client, text="12+7=", sampling_params={**GREEDY, "max_new_tokens": 20, "stop_token_ids": [stop],
                                                        "min_new_tokens": first + 2})
    assert late["meta_info"]["completion_tokens"] >= first + 2


def _ascii_stop(client: TestClient) -> tuple[str, str, str]:
    for prompt in ("12+7=", "hello", "the cat", "3*4=", "What is"):
        text = gen(client, text=prompt, sampling_params={**GREEDY, "max_new_tokens": 32})["text"]
        for i, ch in enumerate(text):
            if i > 0 and ch.isascii() and ch.isalnum():
                return prompt, ch, text
    raise AssertionError("no ASCII character in any greedy output")


def test_stop_strings_trim_unless_no_stop_trim(client: TestClient) -> None:
    prompt, stop, full = _ascii_stop(client)
    params = {**GREEDY, "max_new_tokens": 32, "stop": [stop]}
    out = gen(client, text=prompt, sampling_params=params)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[: full.index(stop)]
    kept = gen(client, text=prompt, sampling_params={**params, "no_stop_trim": True})
    assert kept["text"].endswith(stop) and kept["output_ids"] == out["output_ids"]


def test_zero_new_tokens(client: TestClient) -> None:
    out = gen(client, text="hi", sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_info_endpoints(client: TestClient, model_dir: Path) -> None:
    info = client.get("/model_info").json()
    assert info["weight_version"] == "7" and info["model_path"] == str(model_dir)
    assert info["architectures"] == ["LlamaForCausalLM"] and info["is_generation"] is True
    assert client.get("/get_model_info").json()["weight_version"] == "7"
    server = client.get("/server_info").json()
    assert server == client.get("/get_server_info").json() | {"internal_states": server["internal_states"]}
    assert server["version"] and server["weight_version"] == "7" and "api_key" not in server
    assert server["internal_states"][0]["decode_steps"] >= 0
    models = client.get("/v1/models").json()["data"]
    assert models[0]["id"] == str(model_dir) and models[0]["max_model_len"] == 1024
    load = client.get("/get_load").json()
    assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 0
    for path in ("/health", "/health_generate", "/ready"):
        assert client.get(path).status_code == 200


def test_update_weight_version_and_flush_cache(client: TestClient) -> None:
    r = client.post("/update_weight_version", json={"new_version": "8", "abort_all_requests": False})
    assert r.json() == {"success": True, "message": "Weight version updated to 8", "new_version": "8"}
    try:
        assert (
            gen(client, text="a", sampling_params={"max_new_tokens": 1})["meta_info"]["weight_version"] == "8"
        )
        assert client.get("/model_info").json()["weight_version"] == "8"
        flushed = client.post("/flush_cache")
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
    finally:
        client.post("/update_weight_version", json={"new_version": "7"})


def test_pause_blocks_new_requests_until_continue(client: TestClient) -> None:
    assert client.post("/pause_generation", json={"mode": "abort"}).json()["status"] == "ok"
    results: list[dict] = []
    worker = threading.Thread(target=lambda: results.append(gen(client, text="x", sampling_params=GREEDY)))
    try:
        assert client.get("/health").status_code == 503
        assert client.get("/ready").status_code == 503
        worker.start()
        worker.join(timeout=0.5)
        assert worker.is_alive() and not results  # blocked while paused
    finally:
        client.post("/continue_generation", json={})
    worker.join(timeout=30)
    assert results and results[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert client.get("/health").status_code == 200


def _wait_running(client: TestClient, count: int) -> None:
    deadline = time.monotonic() + 30
    while client.get("/get_load").json()[0]["num_running_reqs"] < count:
        assert time.monotonic() < deadline, "request never started running"
        time.sleep(0.01)


def test_retract_resumes_exactly(client: TestClient) -> None:
    params = {"temperature": 0.8, "sampling_seed": 5, "max_new_tokens": 600, "ignore_eos": True}
    ref = gen(client, text="3*4=", sampling_params=params)
    results: list[dict] = []
    worker = threading.Thread(target=lambda: results.append(gen(client, text="3*4=", sampling_params=params)))
    worker.start()
    _wait_running(client, 1)
    client.post("/pause_generation", json={"mode": "retract"})
    load = client.get("/get_load").json()[0]
    client.post("/continue_generation", json={})
    worker.join(timeout=60)
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 1
    assert results[0]["meta_info"]["num_retractions"] == 1
    assert results[0]["output_ids"] == ref["output_ids"]  # recomputed cache, same generator state


def test_abort_request_by_rid(client: TestClient) -> None:
    params = {"max_new_tokens": 900, "ignore_eos": True}
    results: list[dict] = []
    worker = threading.Thread(
        target=lambda: results.append(gen(client, text="a", sampling_params=params, rid="x"))
    )
    worker.start()
    _wait_running(client, 1)
    assert client.post("/abort_request", json={"rid": "x"}).status_code == 200
    worker.join(timeout=30)
    finish = results[0]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and results[0]["meta_info"]["completion_tokens"] < 900


def test_auth_levels(model_dir: Path) -> None:
    app = create_app(EngineArgs(model_path=str(model_dir), port=1, api_key="user", admin_api_key="admin"))
    user, admin = {"Authorization": "Bearer user"}, {"Authorization": "Bearer admin"}
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
        assert c.get("/model_info").status_code == 401
        assert c.get("/model_info", headers=user).status_code == 200
        body = {"text": "a", "sampling_params": {"max_new_tokens": 1}}
        assert c.post("/generate", json=body).status_code == 401
        assert c.post("/generate", json=body, headers=user).status_code == 200
        version = {"new_version": "z", "abort_all_requests": False}
        assert c.post("/update_weight_version", json=version, headers=user).status_code == 401
        assert c.post("/update_weight_version", json=version, headers=admin).status_code == 200
        assert c.get("/flush_cache").json() == {"error": "Unauthorized"}
    only_user = create_app(EngineArgs(model_path=str(model_dir), port=1, api_key="user"))
    with TestClient(only_user) as c:  # no admin key: control endpoints take the api key
        assert c.post("/flush_cache").status_code == 401
        assert c.post("/flush_cache", headers=user).status_code == 200
