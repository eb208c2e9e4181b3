"""PEFT LoRA adapters: read one, write one as a snapshot, merge one into its base (plain torch).

Contract:
- An adapter directory is PEFT's layout: `adapter_config.json` + `adapter_model.safetensors`
  (or shards named by `adapter_model.safetensors.index.json`). `read_adapter` validates the config
  with pydantic (plain LoRA only: `peft_type` LORA, no DoRA, no bias, no `modules_to_save`, no
  per-module rank/alpha patterns, no `fan_in_fan_out`) and groups the tensors per target module:
  PEFT names them `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`. Every problem is
  an `AdapterError` whose message names the file (and tensor) at fault.
- Scaling is PEFT's: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`.
- `merged_tensors(base, adapter)` yields the base's tensors with `W' = W + scale * B @ A` for every
  target `<module>.weight`, computed in float32 and cast back to W's dtype; an adapter module the
  base lacks, or whose shapes do not fit, is an `AdapterError`.
- `export_merged(adapter_dir, base_dir, dest)` writes the merged model as a full snapshot with
  `write_snapshot` (marker last). `write_adapter_snapshot(adapter_dir, dest)` copies an adapter
  into `dest` with the `.complete` manifest last (the safetensors carry the export id, so the
  completeness check vouches for exactly these files); `write_adapter_tensors(tensors, config,
  dest)` does the same for an adapter held in memory (the two-phase `LoraExport`).
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from pinned_eval.snapshot.errors import ExportError, make_export_dirs
from pinned_eval.snapshot.layout import (
    ADAPTER_CONFIG,
    ADAPTER_INDEX,
    ADAPTER_WEIGHTS,
    EXPORT_ID_KEY,
    INDEX,
    MARKER,
    Manifest,
    fsync_path,
    is_local,
    join,
    resolve,
    to_url,
)

_PREFIX = "base_model.model."


class AdapterError(ExportError, ValueError):
    """An adapter that cannot be used; the message names the file (and tensor) at fault."""


class AdapterConfig(BaseModel):
    """The `adapter_config.json` fields that decide the math; other keys are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    peft_type: Literal["LORA"] = "LORA"
    r: int = Field(ge=1)
    lora_alpha: float = Field(gt=0)
    use_rslora: bool = False
    use_dora: Literal[False] = False
    fan_in_fan_out: Literal[False] = False
    bias: Literal["none"] = "none"
    modules_to_save: list[str] | None = None
    rank_pattern: dict[str, Any] = Field(default_factory=dict)
    alpha_pattern: dict[str, Any] = Field(default_factory=dict)
    target_modules: list[str] | str | None = None

    @model_validator(mode="after")
    def _plain_lora(self) -> AdapterConfig:
        if self.modules_to_save:
            raise ValueError("modules_to_save: full-weight modules are not supported, only LoRA deltas")
        if self.rank_pattern or self.alpha_pattern:
            raise ValueError("rank_pattern/alpha_pattern: per-module ranks are not supported")
        return self

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


@dataclass(frozen=True)
class LoraModule:
    """One target module's delta: `scale * B @ A` (A `[r, in]`, B `[out, r]`)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True)
class LoraAdapter:
    path: str
    config: AdapterConfig
    modules: dict[str, LoraModule]  # module path in the base model (`model.layers.0.self_attn.q_proj`)

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())


def _read_config(root: Path) -> AdapterConfig:
    path = root / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterError(f"{ADAPTER_CONFIG}: missing in {root}")
    try:
        return AdapterConfig.model_validate_json(path.read_bytes())
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise AdapterError(f"{ADAPTER_CONFIG}: {where}: {first['msg']}") from None


def _weight_files(root: Path) -> list[Path]:
    index = root / ADAPTER_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise AdapterError(f"{ADAPTER_INDEX}: unreadable index ({err})") from None
        files = [root / n for n in names]
    else:
        files = [root / ADAPTER_WEIGHTS]
    for f in files:
        if not f.is_file():
            raise AdapterError(f"{f.name}: missing in {root}")
    return files


def read_adapter(adapter_dir: str | Path) -> LoraAdapter:
    """Load and validate a PEFT LoRA adapter directory (tensors in float32)."""
    root = Path(adapter_dir)
    config = _read_config(root)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for path in _weight_files(root):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    module, half = _split(path.name, name)
                    halves.setdefault(module, {})[half] = f.get_tensor(name).float()
        except (SafetensorError, OSError) as err:
            raise AdapterError(f"{path.name}: unreadable safetensors file ({err})") from None
    if not halves:
        raise AdapterError(f"{ADAPTER_WEIGHTS}: holds no LoRA tensors")
    modules = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{ADAPTER_WEIGHTS}: {module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] != config.r:
            raise AdapterError(
                f"{ADAPTER_WEIGHTS}: {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                f"do not form a rank-{config.r} pair"
            )
        modules[module] = LoraModule(a=a, b=b, scale=config.scale)
    return LoraAdapter(path=str(root), config=config, modules=modules)


def _split(fname: str, name: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (`<module>`, "A")."""
    for half in ("A", "B"):
        suffix = f".lora_{half}.weight"
        if name.startswith(_PREFIX) and name.endswith(suffix):
            return name[len(_PREFIX) : -len(suffix)], half
    raise AdapterError(f"{fname}: tensor {name} is not a LoRA A/B weight (plain LoRA on linear layers only)")


def check_fits(adapter: LoraAdapter, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every adapter module must be a 2-D `<module>.weight` of the base with `[out, in]` = `[B.rows, A.cols]`."""
    for module, m in adapter.modules.items():
        key = f"{module}.weight"
        shape = shapes.get(key)
        if shape is None:
            raise AdapterError(f"{ADAPTER_WEIGHTS}: target {module} is not a weight of the base model")
        want = (int(m.b.shape[0]), int(m.a.shape[1]))
        if tuple(shape) != want:
            raise AdapterError(
                f"{ADAPTER_WEIGHTS}: {module}: the adapter is for a [{want[0]}, {want[1]}] weight, "
                f"the base's {key} is {list(shape)}"
            )


def merged_tensors(base: dict[str, torch.Tensor], adapter: LoraAdapter) -> Iterator[tuple[str, torch.Tensor]]:
    """The base tensors with every target's delta added (`W + scale * B @ A`, float32 math)."""
    check_fits(adapter, {k: tuple(v.shape) for k, v in base.items()})
    for name, tensor in base.items():
        module = adapter.modules.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if module is None:
            yield name, tensor
        else:
            merged = tensor.float() + module.scale * (module.b @ module.a)
            yield name, merged.to(tensor.dtype)


def _base_tensors(base_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a local HF dir: the shards its index names, else its `*.safetensors`."""
    index = base_dir / INDEX
    if index.is_file():
        files = [base_dir / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise AdapterError(f"hf_base: no safetensors weights in {base_dir}")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                out[name] = f.get_tensor(name)
    return out


def export_merged(
    adapter_dir: str | Path,
    base_dir: str | Path,
    dest: str,
    *,
    storage_options: dict[str, Any] | None = None,
    max_shard_bytes: int = 2 << 30,
) -> str:
    """Merge the adapter into the base and write a full snapshot at `dest` (marker last); return its URL.

    `adapter_dir` may be `dest` itself (a staged adapter): it is read into memory first and its
    files are removed before the merged snapshot is written.
    """
    from pinned_eval.snapshot.writer import write_snapshot

    adapter = read_adapter(adapter_dir)
    base = _base_tensors(Path(base_dir))
    merged = list(merged_tensors(base, adapter))
    fs, root = resolve(dest, storage_options)
    for name in (MARKER, ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_INDEX):
        path = join(fs, root, name)
        if fs.exists(path):
            fs.rm(path)
    result = write_snapshot(
        merged, dest, base_hf_dir=str(base_dir), storage_options=storage_options, max_shard_bytes=max_shard_bytes,
        metadata={"lora_adapter": str(adapter_dir), "lora_merged": True},
    )
    return result.path


def write_adapter_snapshot(
    adapter: str | Path | Any, dest: str, *, storage_options: dict[str, Any] | None = None
) -> str:
    """Write a PEFT adapter at `dest` as a snapshot: config, weights, then `.complete` last.

    `adapter` is an adapter directory or a PEFT model (`save_pretrained` is called into a temp dir).
    The weights are re-serialised with the export id in their metadata; returns the snapshot URL.
    """
    import tempfile

    if not isinstance(adapter, (str, Path)):
        with tempfile.TemporaryDirectory(prefix="pinned-eval-adapter-") as tmp:
            adapter.save_pretrained(tmp)
            return write_adapter_snapshot(tmp, dest, storage_options=storage_options)
    parsed = read_adapter(adapter)  # validates before anything is written
    tensors = {}
    for path in _weight_files(Path(adapter)):
        with safe_open(path, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    config = (Path(adapter) / ADAPTER_CONFIG).read_bytes()
    return _write_adapter_files(tensors, config, parsed.config.r, dest, storage_options)


def write_adapter_tensors(
    tensors: dict[str, torch.Tensor], config: bytes, dest: str, *, storage_options: dict[str, Any] | None = None
) -> str:
    """Write an adapter held in memory (PEFT names, `adapter_config.json` bytes) as a snapshot at
    `dest`, validated like `read_adapter` before anything is written; config, weights, marker last."""
    try:
        parsed = AdapterConfig.model_validate_json(config)
    except ValidationError as err:
        first = err.errors()[0]
        raise AdapterError(f"{ADAPTER_CONFIG}: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    halves: dict[str, set[str]] = {}
    for name in tensors:
        module, half = _split(ADAPTER_WEIGHTS, name)
        halves.setdefault(module, set()).add(half)
    if not halves:
        raise AdapterError(f"{ADAPTER_WEIGHTS}: holds no LoRA tensors")
    for module, pair in sorted(halves.items()):
        if pair != {"A", "B"}:
            raise AdapterError(f"{ADAPTER_WEIGHTS}: {module} has lora_{''.join(pair)} but not both lora_A and lora_B")
    return _write_adapter_files(tensors, config, parsed.r, dest, storage_options)


def _write_adapter_files(
    tensors: dict[str, torch.Tensor], config: bytes, r: int, dest: str, storage_options: dict[str, Any] | None
) -> str:
    export_id = uuid.uuid4().hex
    weights = save(tensors, metadata={"format": "pt", EXPORT_ID_KEY: export_id})
    fs, root = resolve(dest, storage_options)
    marker = join(fs, root, MARKER)
    if fs.exists(marker):
        fs.rm(marker)  # a stale marker must never vouch for the files written below
    if is_local(fs):
        make_export_dirs(root)  # 0700, below trusted directories only
    else:
        fs.makedirs(root, exist_ok=True)
    if fs.exists(join(fs, root, ADAPTER_INDEX)):  # this writer writes one file; an old index would misname it
        fs.rm(join(fs, root, ADAPTER_INDEX))
    fs.pipe_file(join(fs, root, ADAPTER_CONFIG), config)
    fs.pipe_file(join(fs, root, ADAPTER_WEIGHTS), weights)
    if is_local(fs):  # config and weights are durable before the marker can be
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            fsync_path(join(fs, root, name))
        fsync_path(root)
    manifest = Manifest(
        export_id=export_id,
        index_sha256=hashlib.sha256(b"").hexdigest(),  # no index: the single weights file is the whole set
        total_size=sum(t.numel() * t.element_size() for t in tensors.values()),
        files={ADAPTER_CONFIG: len(config), ADAPTER_WEIGHTS: len(weights)},
        created_at=datetime.now(UTC).isoformat(),
        metadata={"lora_adapter": True, "r": r},
    )
    fs.pipe_file(marker, manifest.model_dump_json(indent=2).encode())
    return to_url(fs, root)
