"""`/generate` logprobs in SGLang's shapes, checked against a direct transformers forward."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from engine.launch import EngineArgs
from engine.server import create_app

PROMPT = [1, 261, 13, 25, 40]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("engine-logprobs") / "m", arch="llama", seed=0)


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    with TestClient(create_app(EngineArgs(model_path=str(model_dir), port=1, weight_version="7"))) as c:
        yield c


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    """log-softmax rows of a plain transformers forward over a token sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def rows(ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits / temperature, dim=-1)

    return rows


def gen(client: TestClient, **body) -> dict | list:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_output_token_logprobs_are_sglang_triples_equal_to_a_forward(client: TestClient, reference) -> None:
    out = gen(client, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    meta = out["meta_info"]
    triples = meta["output_token_logprobs"]
    assert len(triples) == meta["completion_tokens"] == meta["output_token_logprobs_length"] == 6
    assert [t[1] for t in triples] == out["output_ids"]
    assert all(t[2] is None for t in triples)  # no text unless return_text_in_logprobs
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: output tokens only
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta
    assert meta["weight_version"] == "7"  # the version stamp is still there
    rows = reference(PROMPT + out["output_ids"])
    for k, (logprob, token, _) in enumerate(triples):
        expected = float(rows[len(PROMPT) - 1 + k, token])
        assert logprob == pytest.approx(expected, abs=1e-4)
        assert logprob <= 0 and int(torch.argmax(rows[len(PROMPT) - 1 + k])) == token  # greedy


def test_sampled_logprobs_are_temperature_scaled_like_sglangs_sampler(client: TestClient, reference) -> None:
    params = {"temperature": 0.5, "max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 3}
    out = gen(client, input_ids=PROMPT, sampling_params=params, return_logprob=True)
    rows = reference(PROMPT + out["output_ids"], temperature=0.5)
    for k, (logprob, token, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert logprob == pytest.approx(float(rows[len(PROMPT) - 1 + k, token]), abs=1e-4)


def test_prompt_logprobs_from_logprob_start_len(client: TestClient, reference, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2}
    out = gen(client, **body, logprob_start_len=0, return_text_in_logprobs=True)
    meta = out["meta_info"]
    rows = reference(PROMPT)
    inputs = meta["input_token_logprobs"]
    assert [t[1] for t in inputs] == PROMPT and inputs[0][0] is None  # SGLang: the first has none
    for k in range(1, len(PROMPT)):
        assert inputs[k][0] == pytest.approx(float(rows[k - 1, PROMPT[k]]), abs=1e-4)
    assert [t[2] for t in inputs] == [tok.decode([i]) for i in PROMPT]
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(PROMPT) and tops[0] is None
    for k in range(1, len(PROMPT)):
        best = torch.topk(rows[k - 1], 2)
        assert [t[1] for t in tops[k]] == best.indices.tolist()
        assert [t[0] for t in tops[k]] == pytest.approx(best.values.tolist(), abs=1e-4)
    out_tops = meta["output_top_logprobs"]
    assert len(out_tops) == 6 and all(len(row) == 2 for row in out_tops)
    assert [row[0][1] for row in out_tops] == out["output_ids"]  # greedy: the chosen token is the best
    later = gen(client, **body, logprob_start_len=3)["meta_info"]
    assert [t[1] for t in later["input_token_logprobs"]] == PROMPT[3:]
    assert later["input_token_logprobs"][0][0] is None
    assert later["input_token_logprobs"][1][0] == pytest.approx(inputs[4][0], abs=1e-5)


def test_zero_new_tokens_still_scores_the_prompt(client: TestClient, reference) -> None:
    out = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["output_token_logprobs"] == []
    total = sum(t[0] for t in meta["input_token_logprobs"][1:])
    rows = reference(PROMPT)
    assert total == pytest.approx(sum(float(rows[k - 1, PROMPT[k]]) for k in range(1, len(PROMPT))), abs=1e-3)


def test_batches_take_one_logprob_setting_per_prompt(client: TestClient) -> None:
    out = gen(
        client, input_ids=[PROMPT, [1, 9, 9]], sampling_params={**GREEDY, "max_new_tokens": 2},
        return_logprob=[True, False], logprob_start_len=[1, -1],
    )
    assert isinstance(out, list)
    assert [t[1] for t in out[0]["meta_info"]["input_token_logprobs"]] == PROMPT[1:]
    assert "output_token_logprobs" not in out[1]["meta_info"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"logprob_start_len": 6}, "logprob_start_len: 6 is more than the 5 input tokens"),
        ({"logprob_start_len": -2}, "logprob_start_len: must be -1 or >= 0"),
        ({"top_logprobs_num": -1}, "top_logprobs_num: must be >= 0"),
        ({"return_logprob": [True, False]}, "return_logprob: 2 entries for a batch of 1 prompts"),
    ],
)
def test_bad_logprob_fields_are_400_naming_them(client: TestClient, body: dict, needle: str) -> None:
    r = client.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, **body})
    assert r.status_code == 400 and needle in r.json()["error"], r.text


def test_top_p_and_top_k_do_not_renormalise_the_reported_logprobs(client: TestClient, reference) -> None:
    params = {"temperature": 1.0, "top_p": 0.5, "top_k": 5, "max_new_tokens": 3, "ignore_eos": True, "sampling_seed": 9}
    out = gen(client, input_ids=PROMPT, sampling_params=params, return_logprob=True)
    rows = reference(PROMPT + out["output_ids"])
    for k, (logprob, token, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert logprob == pytest.approx(float(rows[len(PROMPT) - 1 + k, token]), abs=1e-4)


@pytest.mark.timeout(60)  # before the fix the request hung forever
def test_a_failing_prompt_forward_fails_the_request_instead_of_hanging_it(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = client.app.state.engine.runner._batch  # type: ignore[attr-defined]

    def boom(ids: list[int]) -> torch.Tensor:
        raise RuntimeError("boom: prompt forward failed")

    monkeypatch.setattr(batch, "full_logits", boom)
    with pytest.raises(RuntimeError, match="boom"):  # TestClient re-raises the server's error
        client.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0})
    monkeypatch.undo()
    assert gen(client, input_ids=PROMPT, sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 6
