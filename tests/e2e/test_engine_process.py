"""A real `pinned-eval engine serve` process on loopback: weight pinning, failure, aborts, batching."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine.tiny_model import perturb_snapshot
from pinned_eval.fleet.cpu_engine import EngineProcess
from tests.e2e.conftest import EngineStarter

pytestmark = pytest.mark.e2e

LONG = {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def snapshot_a(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturb_snapshot(tiny_model_dir, tmp_path_factory.mktemp("snap") / "step-3", seed=3)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    starter = EngineStarter(tmp_path_factory.mktemp("engine-logs"))
    try:
        yield starter(tiny_model_dir, weight_version="0")
    finally:
        starter.stop_all()


@pytest.fixture
def http(engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=60) as client:
        yield client


def load(http: httpx.Client, path: Path | str, version: str, **extra) -> httpx.Response:
    return http.post(
        "/update_weights_from_disk", json={"model_path": str(path), "weight_version": version, **extra}
    )


def wait_running(http: httpx.Client, count: int) -> None:
    deadline = time.monotonic() + 30
    while http.get("/get_load").json()[0]["num_running_reqs"] < count:
        assert time.monotonic() < deadline, "requests never started running"
        time.sleep(0.01)


def test_pin_a_snapshot_and_read_the_version_back(http: httpx.Client, snapshot_a: Path) -> None:
    r = load(http, snapshot_a, "3")
    assert r.status_code == 200
    assert r.json() == {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
    }
    info = http.get("/model_info").json()
    assert info["weight_version"] == "3" and info["model_path"] == str(snapshot_a)
    out = http.post("/generate", json={"text": "1+2=", "sampling_params": {"max_new_tokens": 4}}).json()
    assert out["meta_info"]["weight_version"] == "3" and "weight_versions" not in out["meta_info"]
    assert http.get("/server_info").json()["weight_version"] == "0"  # startup value, like SGLang


def test_failed_load_leaves_weights_unknown_until_a_good_load(
    http: httpx.Client, tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert load(http, tiny_model_dir, "1").status_code == 200
    bad = load(http, tmp_path / "does-not-exist", "2")
    assert bad.status_code == 400 and bad.json()["success"] is False
    assert "does-not-exist" in bad.json()["message"]
    info = http.get("/model_info").json()
    assert info["weight_version"] == "1" and info["model_path"] == str(tiny_model_dir)  # unchanged on failure
    assert http.get("/health").status_code == 503
    assert http.get("/health_generate").status_code == 503
    refused = http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}})
    assert refused.status_code == 503 and "weights unknown" in refused.json()["error"]
    assert load(http, tiny_model_dir, "2").status_code == 200
    assert http.get("/health_generate").status_code == 200
    assert http.get("/model_info").json()["weight_version"] == "2"


def test_abort_all_requests_aborts_in_flight_generations(http: httpx.Client, snapshot_a: Path) -> None:
    body = {"input_ids": [1, 5, 6], "sampling_params": LONG}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(http.post, "/generate", json=body) for _ in range(2)]
        wait_running(http, 2)
        r = load(http, snapshot_a, "4", abort_all_requests=True)
        responses = [f.result(timeout=60) for f in futures]
    assert r.status_code == 200
    for resp in responses:
        assert resp.status_code == 200
        meta = resp.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 900
    assert http.get("/model_info").json()["weight_version"] == "4"


def test_load_waits_for_in_flight_requests(
    http: httpx.Client, tiny_model_dir: Path, snapshot_a: Path
) -> None:
    assert load(http, tiny_model_dir, "5").status_code == 200
    body = {"input_ids": [1, 5, 6], "sampling_params": {**LONG, "max_new_tokens": 300}}
    with ThreadPoolExecutor(2) as pool:
        gen = pool.submit(http.post, "/generate", json=body)
        wait_running(http, 1)
        loaded = pool.submit(load, http, snapshot_a, "6")
        out = gen.result(timeout=60).json()
        assert loaded.result(timeout=60).status_code == 200
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 300}
    assert meta["weight_version"] == "5" and "weight_versions" not in meta  # never saw the new weights
    assert http.get("/model_info").json()["weight_version"] == "6"


def test_client_disconnect_aborts_the_request(http: httpx.Client, engine: EngineProcess) -> None:
    before = http.get("/server_info").json()["internal_states"][0]["requests_aborted"]

    def impatient() -> None:
        with (
            httpx.Client(base_url=engine.url, timeout=httpx.Timeout(10, read=3)) as client,
            pytest.raises(httpx.ReadTimeout),
        ):
            client.post("/generate", json={"input_ids": [1, 5], "sampling_params": LONG})

    with ThreadPoolExecutor(1) as pool:
        gone = pool.submit(impatient)
        wait_running(http, 1)
        http.post("/pause_generation", json={"mode": "in_place"})  # it can no longer finish by itself
        try:
            gone.result(timeout=60)
            deadline = time.monotonic() + 30
            while http.get("/get_load").json()[0]["num_reqs"]:
                assert time.monotonic() < deadline, "the engine kept the abandoned request"
                time.sleep(0.05)
        finally:
            http.post("/continue_generation", json={})
    assert http.get("/server_info").json()["internal_states"][0]["requests_aborted"] == before + 1


def test_concurrent_requests_are_batched(http: httpx.Client) -> None:
    before = http.get("/server_info").json()["internal_states"][0]
    body = {"input_ids": [1, 7, 8], "sampling_params": {**LONG, "max_new_tokens": 64}}
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: http.post("/generate", json=body), range(6)))
    assert all(r.status_code == 200 for r in responses)
    assert len({tuple(r.json()["output_ids"]) for r in responses}) == 1  # greedy, same prompt
    after = http.get("/server_info").json()["internal_states"][0]
    assert after["max_batch_size_seen"] > 1
    assert after["requests_finished"] - before["requests_finished"] == 6
    # 6 x 64 tokens took far fewer forwards than 6 x 64 one-by-one decode steps
    assert after["decode_steps"] - before["decode_steps"] < 6 * 63
    assert http.get("/get_load").json()[0]["max_batch_size_seen"] == after["max_batch_size_seen"]


def test_sigterm_stops_the_engine(start_engine: EngineStarter, tiny_model_dir: Path) -> None:
    proc = start_engine(tiny_model_dir, weight_version="x", api_key="k")
    with httpx.Client(base_url=proc.url, timeout=30) as c:
        assert c.get("/model_info").status_code == 401
        assert c.get("/model_info", headers={"Authorization": "Bearer k"}).json()["weight_version"] == "x"
    assert proc.stop() is not None and proc.proc.poll() is not None


def test_tiny_model_cli_writes_a_loadable_snapshot(tmp_path: Path) -> None:
    out = tmp_path / "tm"
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "tiny-model", "--out", str(out), "--arch", "qwen3", "--seed", "4"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert '"torch_dtype"' in (out / "config.json").read_text()


def test_a_response_longer_than_the_context_is_refused_naming_the_suite_flag(http: httpx.Client) -> None:
    context = http.get("/server_info").json()["context_length"]
    assert context == 1024  # the tiny model's, and the suite's default max_new_tokens
    body = {"input_ids": [1, 7, 8], "sampling_params": {"max_new_tokens": context}}
    refused = http.post("/generate", json=body)
    assert refused.status_code == 400, refused.text
    assert f"requested 3 + {context} tokens, more than the context length ({context}); lower the suite's " \
           "max_new_tokens (`pinned-eval block save suite --max-new-tokens N`" in refused.text
