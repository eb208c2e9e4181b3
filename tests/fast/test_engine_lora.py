"""CPU engine LoRA at forward time: per-row adapters in one batch equal the merged model's outputs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.batch import Sequence
from engine.lora import AdapterError
from engine.protocol import GenerateRequest, ProtocolError
from engine.runner import Runner
from engine.tiny_model import make_tiny_adapter, make_tiny_model
from pinned_eval.snapshot.lora import export_merged
from tests.fast.test_engine_runtime import greedy, reference


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-lora")
    base = make_tiny_model(root / "base", arch="llama", seed=0)
    adapter = make_tiny_adapter(base, root / "adapter", seed=5, scale=2.0)
    merged = Path(export_merged(adapter, base, str(root / "merged")))
    return {"base": base, "adapter": adapter, "merged": merged}


@pytest.fixture(scope="module")
def runner(dirs: dict[str, Path]) -> Iterator[Runner]:
    r = Runner(str(dirs["base"]), "0")
    r.start()
    yield r
    r.stop()


def _generate(runner: Runner, prompts: list[list[int]], adapters: list[str | None], n: int) -> list[list[int]]:
    lora = runner.lora.adapters
    seqs = [
        Sequence(rid=f"r{i}", prompt_ids=p, params=greedy(n), seed=0, lora_name=a, lora=lora[a] if a else None)
        for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))
    ]
    runner.submit(seqs)
    return [s.future.result(timeout=60).output_ids for s in seqs]


def test_rows_with_and_without_the_adapter_share_a_batch(runner: Runner, dirs: dict[str, Path]) -> None:
    runner.call(lambda: runner.lora.load("7", str(dirs["adapter"]))).result(timeout=30)
    try:
        prompts = [[1, 5, 9, 14], [1, 22, 7], [1, 40, 41, 42, 43], [1, 8]]
        adapters: list[str | None] = ["7", None, "7", None]
        got = _generate(runner, prompts, adapters, 8)
        for prompt, adapter, out in zip(prompts, adapters, got, strict=True):
            want = reference(dirs["merged"] if adapter else dirs["base"], prompt, 8)
            assert out == want, (adapter, prompt)
        # the adapter changes generations (so the equalities above can fail)
        assert got[0] != reference(dirs["base"], prompts[0], 8) or got[2] != reference(dirs["base"], prompts[2], 8)
        assert runner.lora.loaded() == {"7": str(dirs["adapter"])}
    finally:
        runner.call(lambda: runner.lora.unload("7")).result(timeout=30)
    assert runner.lora.loaded() == {}


def test_duplicate_and_unknown_names_are_refused(runner: Runner, dirs: dict[str, Path]) -> None:
    runner.call(lambda: runner.lora.load("a", str(dirs["adapter"]))).result(timeout=30)
    try:
        with pytest.raises(AdapterError, match="already loaded"):
            runner.call(lambda: runner.lora.load("a", str(dirs["adapter"]))).result(timeout=30)
        with pytest.raises(AdapterError, match="already loaded with name: a"):
            runner.call(lambda: runner.lora.load("b", str(dirs["adapter"]))).result(timeout=30)
    finally:
        runner.call(lambda: runner.lora.unload("a")).result(timeout=30)
    with pytest.raises(AdapterError, match="does not exist"):
        runner.call(lambda: runner.lora.unload("a")).result(timeout=30)


def test_an_adapter_that_does_not_fit_names_the_file(runner: Runner, dirs: dict[str, Path], tmp_path: Path) -> None:
    tensors = load_file(dirs["adapter"] / "adapter_model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("lora_B.weight"))
    tensors[name] = torch.zeros(tensors[name].shape[0] * 2, tensors[name].shape[1])
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text((dirs["adapter"] / "adapter_config.json").read_text())
    with pytest.raises(AdapterError, match=r"^adapter_model\.safetensors: .* the base's"):
        runner.call(lambda: runner.lora.load("bad", str(tmp_path))).result(timeout=30)
    cfg = json.loads((dirs["adapter"] / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match=r"^adapter_config\.json: use_dora"):
        runner.call(lambda: runner.lora.load("bad", str(tmp_path))).result(timeout=30)
    assert runner.lora.loaded() == {}


def test_lora_path_per_prompt_of_a_batch() -> None:
    req = GenerateRequest.model_validate({"input_ids": [[1, 2], [1, 3]], "lora_path": ["x", None]})
    assert [i.lora_name for i in req.items()] == ["x", None]
    single = GenerateRequest.model_validate({"text": "hi", "lora_path": "x"})
    assert [i.lora_name for i in single.items()] == ["x"]
    with pytest.raises(ProtocolError, match="lora_path: 1 entries for a batch of 2"):
        GenerateRequest.model_validate({"input_ids": [[1, 2], [1, 3]], "lora_path": ["x"]}).items()
