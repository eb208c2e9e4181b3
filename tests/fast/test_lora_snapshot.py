"""LoRA snapshots: the merge exporter against PEFT, the adapter snapshot writer, and the check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.tiny_model import make_tiny_adapter, make_tiny_model
from pinned_eval.snapshot.check import SnapshotProblem, check_snapshot
from pinned_eval.snapshot.lora import AdapterError, export_merged, read_adapter, write_adapter_snapshot


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora-base") / "model")


@pytest.fixture(scope="module")
def adapter(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_adapter(base, tmp_path_factory.mktemp("lora-adapter") / "adapter", seed=3)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_snapshot_logits_equal_peft_base_plus_adapter(base: Path, adapter: Path, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft", reason="peft (dev extra) is the reference implementation")
    from transformers import AutoModelForCausalLM

    dest = export_merged(adapter, base, str(tmp_path / "merged"), max_shard_bytes=64 * 1024)
    assert check_snapshot(dest).complete
    merged = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    reference = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
    ).eval()
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ids = torch.randint(3, 300, (3, 17), generator=torch.Generator().manual_seed(0))
    want, got = _logits(reference, ids), _logits(merged, ids)
    assert (want - got).abs().max().item() <= 1e-5
    # the adapter matters: base logits are far from base+adapter (so the equality above can fail)
    assert (want - _logits(plain, ids)).abs().max().item() > 1e-2


def test_merge_scales_like_peft_rslora(base: Path, adapter: Path, tmp_path: Path) -> None:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    rs = tmp_path / "rslora"
    rs.mkdir()
    (rs / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    (rs / "adapter_config.json").write_text(json.dumps({**cfg, "use_rslora": True}))
    assert read_adapter(rs).config.scale == pytest.approx(cfg["lora_alpha"] / cfg["r"] ** 0.5)
    assert read_adapter(adapter).config.scale == pytest.approx(cfg["lora_alpha"] / cfg["r"])


def test_adapter_snapshot_is_checked_like_any_snapshot(adapter: Path, tmp_path: Path) -> None:
    dest = str(tmp_path / "step_5")
    write_adapter_snapshot(adapter, dest)
    result = check_snapshot(dest)
    assert result.complete, result.detail
    assert sorted(p.name for p in Path(dest).iterdir()) == [
        ".complete", "adapter_config.json", "adapter_model.safetensors"
    ]
    weights = Path(dest) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    truncated = check_snapshot(dest)
    assert truncated.problem is SnapshotProblem.TRUNCATED_SHARD
    assert "adapter_model.safetensors" in truncated.detail
    weights.unlink()
    missing = check_snapshot(dest, adapter=True)
    assert missing.problem is SnapshotProblem.MISSING_SHARD and "adapter_model.safetensors" in missing.detail
    (Path(dest) / "adapter_config.json").unlink()
    assert "adapter_config.json" in check_snapshot(dest, adapter=True).detail


def test_adapter_snapshot_marker_vouches_for_its_files(adapter: Path, tmp_path: Path) -> None:
    dest = str(tmp_path / "step_6")
    write_adapter_snapshot(adapter, dest)
    other = tmp_path / "other"
    write_adapter_snapshot(adapter, str(other))  # same tensors, another export id
    # a weights file from another export under this marker is stale
    (Path(dest) / "adapter_model.safetensors").write_bytes((other / "adapter_model.safetensors").read_bytes())
    assert check_snapshot(dest).problem is SnapshotProblem.STALE_MARKER


def test_adapter_that_does_not_fit_the_base_names_the_file(base: Path, adapter: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(adapter / "adapter_model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("lora_A.weight"))
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 8)
    save_file(tensors, bad / "adapter_model.safetensors")
    (bad / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: .*q_proj|adapter_model\.safetensors"):
        export_merged(bad, base, str(tmp_path / "merged"))
    assert not (tmp_path / "merged" / ".complete").exists()


def test_unsupported_adapter_configs_name_the_field(adapter: Path, tmp_path: Path) -> None:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    for update, field in (({"use_dora": True}, "use_dora"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                          ({"r": 0}, "r")):
        bad = tmp_path / field
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, **update}))
        (bad / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
        with pytest.raises(AdapterError, match=rf"adapter_config\.json: .*{field}|adapter_config\.json: {field}"):
            read_adapter(bad)


def test_a_trainers_peft_model_is_written_and_merged_like_peft(base: Path, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft", reason="peft (dev extra) is the reference implementation")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "gate_proj"],
                             init_lora_weights=False, use_rslora=True)
    trained = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config).eval()
    staged = write_adapter_snapshot(trained, str(tmp_path / "step_9"))
    assert check_snapshot(staged).complete
    assert len(read_adapter(staged).modules) == 3 * 2  # 3 targets x 2 layers
    merged = AutoModelForCausalLM.from_pretrained(export_merged(staged, base, str(tmp_path / "merged")),
                                                  dtype=torch.float32).eval()
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    assert (_logits(trained, ids) - _logits(merged, ids)).abs().max().item() <= 1e-5


def test_a_sharded_base_merges_to_the_same_tensors(base: Path, adapter: Path, tmp_path: Path) -> None:
    sharded = make_tiny_model(tmp_path / "sharded", max_shard_size="100KB")  # same seed: same weights
    assert (sharded / "model.safetensors.index.json").exists()
    a = Path(export_merged(adapter, base, str(tmp_path / "a")))
    b = Path(export_merged(adapter, sharded, str(tmp_path / "b"), max_shard_bytes=64 * 1024))
    ta = {k: v for f in sorted(a.glob("*.safetensors")) for k, v in load_file(f).items()}
    tb = {k: v for f in sorted(b.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
