"""Load a snapshot's safetensors into a live model of the same architecture (in place).

Contract:
- `weight_files(dir)`: the shards named by `model.safetensors.index.json` when present (every one
  must exist), else every `*.safetensors` in the directory.
- `load_into(model, dir)` first reads every header and checks the plan against the live model:
  each parameter must be present exactly once (tied parameters, e.g. a tied `lm_head.weight`,
  need only one of their names), no unknown tensor names, identical shapes, and a `config.json`
  (when present) with the same `model_type`. Only then are tensors copied, cast to the model's
  dtype. Any problem raises `WeightLoadError` whose message names the file or tensor.
- A failure during the copy phase leaves the model partly updated; callers must treat every
  failed load as "weights unknown" (as SGLang does, whose rollback reloads the bad path).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

SUPPORTED_LOAD_FORMATS = (None, "auto", "safetensors")


class WeightLoadError(RuntimeError):
    """A snapshot could not be loaded; the message says which file or tensor and why."""


@dataclass(frozen=True)
class LoadReport:
    files: int
    tensors: int
    bytes: int


def weight_files(snapshot: Path) -> list[Path]:
    """The safetensors files of `snapshot` (index-named shards, else `*.safetensors`)."""
    snapshot = Path(snapshot)
    if not snapshot.is_dir():
        raise WeightLoadError(f"model_path: {snapshot} is not a directory")
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise WeightLoadError(f"{index.name}: unreadable index ({err})") from None
        files = [snapshot / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"{index.name}: shards missing: {', '.join(missing)}")
        return files
    files = sorted(snapshot.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"model_path: no safetensors files in {snapshot}")
    return files


def _expected(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """Parameter name -> tensor, and groups of names sharing one storage (tied weights)."""
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(tensor.data_ptr(), []).append(name)
    return state, list(groups.values())


def _check_config(model: torch.nn.Module, snapshot: Path) -> None:
    config_path = snapshot / "config.json"
    if not config_path.is_file():
        return
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except json.JSONDecodeError as err:
        raise WeightLoadError(f"config.json: unreadable ({err})") from None
    live = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is not None and live is not None and model_type != live:
        raise WeightLoadError(f"config.json: model_type {model_type!r} differs from the served {live!r}")


def plan(model: torch.nn.Module, snapshot: Path) -> dict[str, Path]:
    """Check the snapshot against the model (headers only); return tensor name -> file."""
    snapshot = Path(snapshot)
    files = weight_files(snapshot)
    _check_config(model, snapshot)
    state, groups = _expected(model)
    where: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if name in where:
                        raise WeightLoadError(f"{path.name}: tensor {name} also in {where[name].name}")
                    if name not in state:
                        raise WeightLoadError(f"{path.name}: unexpected tensor {name}")
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(state[name].shape):
                        raise WeightLoadError(
                            f"{path.name}: tensor {name} has shape {list(shape)}, "
                            f"the model expects {list(state[name].shape)}"
                        )
                    where[name] = path
        except (SafetensorError, OSError) as err:
            raise WeightLoadError(f"{path.name}: unreadable safetensors file ({err})") from None
    missing = [group[0] for group in groups if not any(n in where for n in group)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise WeightLoadError(f"model_path: tensors missing from the snapshot: {shown}")
    return where


@torch.no_grad()
def load_into(model: torch.nn.Module, snapshot: Path) -> LoadReport:
    """Validate, then copy every tensor of `snapshot` into `model` in place."""
    where = plan(model, snapshot)
    state, _ = _expected(model)
    by_file: dict[Path, list[str]] = {}
    for name, path in where.items():
        by_file.setdefault(path, []).append(name)
    total = 0
    for path, names in by_file.items():
        try:
            with safe_open(path, framework="pt") as f:
                for name in names:
                    src = f.get_tensor(name)
                    state[name].data.copy_(src.to(state[name].dtype))
                    total += src.numel() * src.element_size()
        except (SafetensorError, OSError) as err:
            raise WeightLoadError(f"{path.name}: failed while reading tensors ({err})") from None
    return LoadReport(files=len(by_file), tensors=len(where), bytes=total)
