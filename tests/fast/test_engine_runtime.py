"""Engine internals on a real tiny model: continuous batching, weight loading, token choice."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import decoding
from engine.batch import Sequence
from engine.protocol import SamplingParams
from engine.runner import Runner
from engine.tiny_model import make_tiny_model, perturb_snapshot
from engine.weights import WeightLoadError, load_into, weight_files


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-runtime")
    base = make_tiny_model(root / "base", arch="llama", seed=0)
    sharded = make_tiny_model(root / "sharded", arch="llama", seed=0, max_shard_size="100KB")
    return {
        "base": base,
        "sharded": sharded,
        "step2": perturb_snapshot(sharded, root / "step2", seed=2),
        "qwen2": make_tiny_model(root / "qwen2", arch="qwen2", seed=1),
        "qwen3": make_tiny_model(root / "qwen3", arch="qwen3", seed=1),
        "narrow": make_tiny_model(root / "narrow", arch="llama", seed=0, hidden_size=32),
    }


@pytest.fixture(scope="module")
def runner(snapshots: dict[str, Path]) -> Iterator[Runner]:
    r = Runner(str(snapshots["base"]), "0")
    r.start()
    yield r
    r.stop()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def reference(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_newcomers_join_a_running_batch_without_changing_results(runner: Runner, snapshots) -> None:
    long_prompt, short_prompt, longer_prompt = [1, 5, 6, 7], [1, 9], list(range(1, 40))
    a = Sequence(rid="a", prompt_ids=long_prompt, params=greedy(120), seed=0)
    runner.submit([a])
    deadline = time.monotonic() + 30
    while len(a.output_ids) < 10:  # a is decoding: its cache is wider than b's prompt
        assert time.monotonic() < deadline
        time.sleep(0.001)
    b = Sequence(rid="b", prompt_ids=short_prompt, params=greedy(30), seed=0)
    c = Sequence(rid="c", prompt_ids=longer_prompt, params=greedy(30), seed=0)
    before = runner.stats.prefill_batches
    runner.submit([b])
    runner.submit([c])
    results = [s.future.result(timeout=60) for s in (a, b, c)]
    assert runner.stats.prefill_batches > before
    assert runner.stats.max_batch_size_seen >= 2
    assert results[0].output_ids == reference(snapshots["base"], long_prompt, 120)
    assert results[1].output_ids == reference(snapshots["base"], short_prompt, 30)
    assert results[2].output_ids == reference(snapshots["base"], longer_prompt, 30)


def test_load_weights_changes_outputs_and_version_spans(runner: Runner, snapshots) -> None:
    prompt = [1, 5, 6]
    before = runner.load_weights(str(snapshots["step2"]), "2", None)
    assert before.result(timeout=30).tensors == len(load_file(weight_files(snapshots["base"])[0]))
    seq = Sequence(rid="s", prompt_ids=prompt, params=greedy(8), seed=0)
    runner.submit([seq])
    out = seq.future.result(timeout=30)
    assert out.weight_version == "2" and out.weight_versions is None
    assert out.output_ids == reference(snapshots["step2"], prompt, 8)
    assert runner.model_path == str(snapshots["step2"])
    runner.load_weights(str(snapshots["base"]), "0", None).result(timeout=30)


def test_a_version_change_mid_request_is_reported_as_spans(runner: Runner) -> None:
    seq = Sequence(rid="spans", prompt_ids=[1, 5], params=greedy(300), seed=0)
    runner.submit([seq])
    while len(seq.output_ids) < 3:
        time.sleep(0.001)
    runner.set_weight_version("relabelled").result(timeout=30)
    out = seq.future.result(timeout=60)
    runner.set_weight_version("0").result(timeout=30)
    spans = out.weight_versions
    assert spans is not None and [s["version"] for s in spans] == ["0", "relabelled"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 300
    assert out.weight_version == "relabelled"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures_serve_and_reload(snapshots, arch: str) -> None:
    r = Runner(str(snapshots[arch]), "a")
    r.start()
    try:
        seq = Sequence(rid="q", prompt_ids=[1, 5, 6], params=greedy(6), seed=0)
        r.submit([seq])
        assert seq.future.result(timeout=30).output_ids == reference(snapshots[arch], [1, 5, 6], 6)
        r.load_weights(str(snapshots[arch]), "b", None).result(timeout=30)  # tied lm_head absent: fine
        assert r.weight_version == "b" and r.weights_ok
    finally:
        r.stop()


def _copy_without(src: Path, dst: Path, drop: str | None = None, extra: str | None = None) -> Path:
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    if drop:
        tensors.pop(drop)
    if extra:
        tensors[extra] = torch.zeros(2)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_loader_rejects_bad_snapshots_naming_the_problem(snapshots, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(snapshots["base"])
    base = snapshots["base"]
    cases = {
        "model.norm.weight": _copy_without(base, tmp_path / "missing", drop="model.norm.weight"),
        "unexpected tensor bogus.weight": _copy_without(base, tmp_path / "extra", extra="bogus.weight"),
        "has shape [320, 32]": snapshots["narrow"],
        "qwen2": snapshots["qwen2"],
        "is not a directory": tmp_path / "nope",
        "no safetensors files": tmp_path,
    }
    for needle, path in cases.items():
        with pytest.raises(WeightLoadError, match=needle.replace("[", r"\[")):
            load_into(model, path)
    broken = tmp_path / "broken"
    broken.mkdir()
    index = json.loads((snapshots["sharded"] / "model.safetensors.index.json").read_text())
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match="shards missing"):
        load_into(model, broken)
    truncated = _copy_without(base, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match=r"model\.safetensors"):
        load_into(model, truncated)


def test_sharded_load_copies_every_tensor(snapshots) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(snapshots["base"])
    report = load_into(model, snapshots["step2"])
    assert report.files == len(weight_files(snapshots["step2"])) > 1
    state = model.state_dict()
    for path in weight_files(snapshots["step2"]):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                assert torch.equal(state[name], f.get_tensor(name)), name


def test_perturbed_snapshot_keeps_layout_but_not_values(snapshots) -> None:
    a, b = snapshots["sharded"], snapshots["step2"]
    assert [p.name for p in weight_files(a)] == [p.name for p in weight_files(b)]
    ta, tb = load_file(weight_files(a)[0]), load_file(weight_files(b)[0])
    assert ta.keys() == tb.keys()
    assert all(ta[k].shape == tb[k].shape and not torch.equal(ta[k], tb[k]) for k in ta)
    assert (b / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


def test_choose_token_rules() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    gen = decoding.make_generator(0)
    pick = lambda **kw: decoding.choose_token(logits, SamplingParams(**kw), [], [], gen, [])  # noqa: E731
    assert pick(temperature=0) == 1
    assert pick(top_k=1) == 1
    assert pick(top_p=0.01) == 1
    assert pick(min_p=0.999) == 1
    assert pick(temperature=0, logit_bias={"3": 10.0}) == 3
    assert (
        decoding.choose_token(logits, SamplingParams(temperature=0, repetition_penalty=2.0), [1], [], gen, [])
        == 2
    )
    banned = SamplingParams(temperature=0, min_new_tokens=2)
    assert decoding.choose_token(logits, banned, [], [7], gen, [1]) == 2  # stop token 1 banned before min
    draws = {pick(temperature=1.0, top_k=2) for _ in range(200)}
    assert draws == {1, 2}
    seeded = [
        decoding.choose_token(logits, SamplingParams(), [], [], decoding.make_generator(9), [])
        for _ in range(3)
    ]
    assert len(set(seeded)) == 1


def test_finish_reason_and_text_trimming() -> None:
    decode = lambda ids, skip: "".join(chr(96 + i) for i in ids)  # noqa: E731 - 1->a, 2->b ...
    p = SamplingParams(stop=["cd"], max_new_tokens=10)
    assert decoding.finish_reason(p, [1, 3, 4], "acd", [2], 3, 100) == {"type": "stop", "matched": "cd"}
    assert decoding.output_text(decode, [1, 3, 4], p, {"type": "stop", "matched": "cd"}) == "a"
    assert decoding.finish_reason(SamplingParams(), [5, 2], None, [2], 3, 100) == {
        "type": "stop",
        "matched": 2,
    }
    assert decoding.finish_reason(SamplingParams(ignore_eos=True), [5, 2], None, [2], 3, 100) is None
    assert decoding.finish_reason(SamplingParams(max_new_tokens=2), [5, 6], None, [2], 3, 100) == {
        "type": "length", "length": 2}
    assert decoding.finish_reason(SamplingParams(), [5, 6], None, [2], 8, 10) == {
        "type": "length",
        "length": 2,
    }
    eos = {"type": "stop", "matched": 2}
    assert decoding.output_text(decode, [1, 2], SamplingParams(), eos) == "a"
    assert decoding.output_text(decode, [1, 2], SamplingParams(no_stop_trim=True), eos) == "ab"
    rx = SamplingParams(stop_regex=["c+d"])
    assert decoding.finish_reason(rx, [1, 3, 3, 4], "accd", [2], 3, 100) == {"type": "stop", "matched": "c+d"}
    assert decoding.output_text(decode, [1, 3, 3, 4], rx, {"type": "stop", "matched": "c+d"}) == "a"
