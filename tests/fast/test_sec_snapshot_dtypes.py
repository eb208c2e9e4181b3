"""A safetensors tensor whose dtype contradicts `config.json` (BOOL or an integer in a float model)
is refused by the snapshot check, naming shard, tensor and both dtypes; legitimate mixes pass.

Before the fix a BOOL tensor in a float32 model was accepted as complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pinned_eval.snapshot.check import SnapshotProblem, check_snapshot
from tests.snapshot_fixtures import tiny_hf_base

NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_base(tmp_path_factory.mktemp("dtypes") / "base", "llama")


def _variant(base: Path, dest: Path, name: str, dtype: torch.dtype, config: dict[str, object] | None = None) -> Path:
    """A copy of `base` (config, one shard, no marker) with tensor `name` stored as `dtype`."""
    dest.mkdir()
    tensors = load_file(str(base / "model.safetensors"))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((base / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return dest


def test_a_bool_tensor_in_a_float32_model_is_refused_naming_tensor_and_dtypes(base: Path, tmp_path: Path) -> None:
    snap = _variant(base, tmp_path / "bool", EMBED, torch.bool)
    result = check_snapshot(str(snap), require_marker=False)
    assert (result.complete, result.problem) == (False, SnapshotProblem.DTYPE_MISMATCH)
    assert result.detail == (f"model.safetensors: tensor {EMBED!r} is BOOL, but config.json torch_dtype is float32: "
                             "a floating-point model holds floating-point tensors only")


def test_an_integer_tensor_in_a_bf16_model_is_refused(base: Path, tmp_path: Path) -> None:
    snap = _variant(base, tmp_path / "int", NORM, torch.int32, {"torch_dtype": "bfloat16", "dtype": "bfloat16"})
    result = check_snapshot(str(snap), require_marker=False)
    assert result.problem is SnapshotProblem.DTYPE_MISMATCH
    said = f"model.safetensors: tensor {NORM!r} is I32, but config.json torch_dtype is bfloat16"
    assert result.detail.startswith(said)


@pytest.mark.parametrize(("dtype", "config"), [
    (torch.bfloat16, {}),  # a bf16 tensor in a float32 model: transformers casts on load
    (torch.float32, {"torch_dtype": "bfloat16", "dtype": "bfloat16"}),  # an F32 norm in a bf16 model
    (torch.float8_e4m3fn, {"torch_dtype": "bfloat16", "dtype": "bfloat16"}),  # FP8 weights
])
def test_mixed_floating_point_tensors_are_legitimate(
    base: Path, tmp_path: Path, dtype: torch.dtype, config: dict[str, object]
) -> None:
    snap = _variant(base, tmp_path / "mixed", NORM, dtype, config)
    assert check_snapshot(str(snap), require_marker=False).complete


def test_integers_pass_in_a_quantized_model_or_without_a_float_config(base: Path, tmp_path: Path) -> None:
    quantized = _variant(base, tmp_path / "q", NORM, torch.int32, {"quantization_config": {"quant_method": "gptq"}})
    assert check_snapshot(str(quantized), require_marker=False).complete
    no_dtype = _variant(base, tmp_path / "nd", NORM, torch.int32)
    cfg = json.loads((no_dtype / "config.json").read_text())
    cfg.pop("torch_dtype"), cfg.pop("dtype", None)
    (no_dtype / "config.json").write_text(json.dumps(cfg))
    assert check_snapshot(str(no_dtype), require_marker=False).complete


def _with_config(snap: Path, cfg: dict[str, object], pad_to: int | None = None) -> Path:
    """Replace the snapshot's config with `cfg`, padded with trailing spaces to `pad_to` bytes."""
    text = json.dumps(cfg)
    (snap / "config.json").write_text(text if pad_to is None else text.ljust(pad_to))
    return snap


def _int_norm(base: Path, dest: Path) -> tuple[Path, dict[str, object]]:
    snap = _variant(base, dest, NORM, torch.int32)
    cfg = json.loads((snap / "config.json").read_text())
    cfg.pop("torch_dtype", None), cfg.pop("dtype", None)
    return snap, cfg


def test_the_dtype_key_alone_with_a_torch_prefix_is_checked_and_named(base: Path, tmp_path: Path) -> None:
    snap, cfg = _int_norm(base, tmp_path / "d")
    result = check_snapshot(str(_with_config(snap, {**cfg, "dtype": "torch.float16"})), require_marker=False)
    assert (result.problem, result.detail) == (
        SnapshotProblem.DTYPE_MISMATCH,
        f"model.safetensors: tensor {NORM!r} is I32, but config.json dtype is torch.float16: "
        "a floating-point model holds floating-point tensors only")


def test_an_explicit_null_quantization_config_is_not_a_quantized_model(base: Path, tmp_path: Path) -> None:
    snap, cfg = _int_norm(base, tmp_path / "n")
    config = {**cfg, "torch_dtype": "float32", "quantization_config": None}
    result = check_snapshot(str(_with_config(snap, config)), require_marker=False)
    assert result.problem is SnapshotProblem.DTYPE_MISMATCH


def test_a_non_float_dtype_value_or_a_non_object_config_is_nothing_to_check_against(
    base: Path, tmp_path: Path
) -> None:
    snap, cfg = _int_norm(base, tmp_path / "i")
    assert check_snapshot(str(_with_config(snap, {**cfg, "torch_dtype": "int8"})), require_marker=False).complete
    snap2, _ = _int_norm(base, tmp_path / "l")
    assert check_snapshot(str(_with_config(snap2, [cfg])), require_marker=False).complete  # type: ignore[arg-type]


def test_a_config_of_exactly_the_size_limit_is_still_read(base: Path, tmp_path: Path) -> None:
    from pinned_eval.snapshot.check import MAX_CONFIG

    snap, cfg = _int_norm(base, tmp_path / "big")
    _with_config(snap, {**cfg, "torch_dtype": "float32"}, pad_to=MAX_CONFIG)
    assert (snap / "config.json").stat().st_size == MAX_CONFIG
    assert check_snapshot(str(snap), require_marker=False).problem is SnapshotProblem.DTYPE_MISMATCH
