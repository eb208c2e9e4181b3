"""`state_dict` source: a safetensors or torch state-dict file + a base HF dir -> a snapshot.

Contract of `export_state_dict`:
- the file is `*.safetensors` (read lazily, one tensor at a time) or a torch file (`.pt`, `.bin`,
  `.pth`; `torch.load(weights_only=True, mmap=True)`), a flat {name: tensor} mapping in HF names;
- names and shapes are validated, before anything is written, against the parameters the base
  config's architecture expects (`AutoModelForCausalLM.from_config` on the meta device; a tied
  `lm_head.weight` is not expected). A tied weight present in the file is accepted only when it
  equals the weight it is tied to, and is then not written;
- the snapshot is written by `write_snapshot` with the base dir's config/tokenizer files.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pinned_eval.snapshot.errors import ExportError
from pinned_eval.snapshot.writer import TensorSpec, WriteResult, write_snapshot

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
TORCH_SUFFIXES = (".pt", ".bin", ".pth")


class StateDictMismatchError(ExportError, ValueError):
    """The state dict does not fit the base config's architecture (names the offending tensors)."""


def expected_parameters(hf_base_dir: str | Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """({name: shape} the architecture expects, {tied name: the name it is tied to})."""
    from transformers import AutoConfig, AutoModelForCausalLM  # transformers: slow import, only to read a base config

    cfg = AutoConfig.from_pretrained(str(hf_base_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expected: dict[str, tuple[int, ...]] = {}
    tied: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in first_name:  # tied: the same Parameter under a second name
            tied[name] = first_name[id(t)]
            continue
        first_name[id(t)] = name
        expected[name] = tuple(t.shape)
    return expected, tied


class _Source:
    """Names, specs and a lazy tensor stream of one state-dict file."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self._sd: dict[str, Any] | None = None
        if file.suffix == ".safetensors":
            with safe_open(str(file), "pt") as f:
                self.specs = {}
                for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    sl = f.get_slice(k)
                    dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise StateDictMismatchError(f"tensor {k!r}: unsupported dtype {sl.get_dtype()}")
                    self.specs[k] = TensorSpec(k, tuple(sl.get_shape()), dtype)
        elif file.suffix in TORCH_SUFFIXES:
            sd = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(sd, dict):
                kind = type(sd).__name__
                raise StateDictMismatchError(f"{file.name}: expected a {{name: tensor}} dict, got {kind}")
            for k, v in sd.items():
                if not isinstance(k, str) or not isinstance(v, torch.Tensor):
                    raise StateDictMismatchError(f"{file.name}: entry {k!r} is not a named tensor")
            self._sd = sd
            self.specs = {k: TensorSpec.of(k, v) for k, v in sd.items()}
        else:
            raise StateDictMismatchError(
                f"{file.name}: unsupported suffix {file.suffix!r} (.safetensors, {', '.join(TORCH_SUFFIXES)})"
            )

    def get(self, name: str) -> torch.Tensor:
        if self._sd is not None:
            return self._sd[name]

        with safe_open(str(self.file), "pt") as f:
            return f.get_tensor(name)

    def stream(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        if self._sd is not None:
            yield from ((n, self._sd[n]) for n in names)
            return

        with safe_open(str(self.file), "pt") as f:
            for n in names:
                yield n, f.get_tensor(n)


def _validate(src: _Source, expected: dict[str, tuple[int, ...]], tied: dict[str, str]) -> list[str]:
    """The names to write, in the architecture's order; raise on any mismatch."""
    names = set(src.specs)
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected) - set(tied))
    if missing or unexpected:
        raise StateDictMismatchError(
            f"state dict does not match the base config: missing {len(missing)} {missing[:5]}, "
            f"unexpected {len(unexpected)} {unexpected[:5]}"
        )
    wrong = [f"{n}: {src.specs[n].shape} != {s}" for n, s in expected.items() if src.specs[n].shape != s]
    if wrong:
        raise StateDictMismatchError(f"{len(wrong)} tensors have the wrong shape, e.g. {wrong[:3]}")
    for name in sorted(names & set(tied)):
        if not torch.equal(src.get(name), src.get(tied[name])):
            raise StateDictMismatchError(
                f"{name} is tied to {tied[name]} in the base config but differs from it in the state dict"
            )
    return list(expected)


def export_state_dict(
    file: str | Path,
    hf_base_dir: str | Path,
    dest: str,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 << 30,
    storage_options: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> WriteResult:
    """Validate `file` against the base config and write it as a snapshot at `dest`.

    `dtype` casts floating-point tensors (e.g. fp32 master weights -> bf16); None keeps each dtype.
    """
    src = _Source(Path(file))
    expected, tied = expected_parameters(hf_base_dir)
    names = _validate(src, expected, tied)
    plan = []
    for n in names:
        spec = src.specs[n]
        if dtype is not None and spec.dtype.is_floating_point:
            spec = TensorSpec(n, spec.shape, dtype)
        plan.append(spec)
    meta = {"source": "state_dict", "file": Path(file).name, **(metadata or {})}
    return write_snapshot(src.stream(names), dest, plan=plan, base_hf_dir=str(hf_base_dir),
                          max_shard_bytes=max_shard_bytes, storage_options=storage_options, metadata=meta)
