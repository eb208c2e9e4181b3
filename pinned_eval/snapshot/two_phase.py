"""The shipped two-phase in-loop exporters: HF state dict and PEFT LoRA adapter.

Hand one to `EvalClient.dispatch(step, export=...)` (or as the client's `exporter`): `dispatch`
runs phase 1, `stage`, which copies the step's tensors into the client's reusable host buffer
(`pinned_eval.snapshot.host_staging.HostStaging`) and returns once every byte is on the host;
the training loop may then change the weights. Phase 2, `Staged.write`, writes the snapshot in
the client's background thread (shards, index, fsync, `.complete` last) and only then is the
point requested. A plain `export(step, dest)` callable is not two-phase: `dispatch` runs it to
completion, as before.

- `StateDictExport(source, base_hf_dir)`: `source` is a module (its `state_dict()`), a mapping
  or a callable returning (name, tensor) pairs in HF names; `dtype` casts floating tensors while
  they are staged (e.g. fp32 master weights -> a bf16 snapshot: the buffer is the bf16 size);
  the snapshot is `write_snapshot`'s, with the base dir's config and tokenizer files and
  `metadata` + `{"step": step}` in its manifest.
- `LoraExport(tensors, config)`: PEFT-named adapter tensors (`base_model.model.<module>.lora_A.weight`)
  and `adapter_config.json` as a dict; `LoraExport.from_peft(peft_model)` reads both from a PEFT
  model (`get_peft_model_state_dict`, `peft_config`). Written by `lora.write_adapter_tensors`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pinned_eval.snapshot.host_staging import HostStaging
from pinned_eval.snapshot.lora import write_adapter_tensors
from pinned_eval.snapshot.writer import TensorSpec, WriteResult, write_snapshot

NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]


def _named(source: torch.nn.Module | Mapping[str, torch.Tensor] | NamedTensors) -> list[tuple[str, torch.Tensor]]:
    if isinstance(source, torch.nn.Module):
        return list(source.state_dict().items())
    if isinstance(source, Mapping):
        return list(source.items())
    return list(source())


@dataclass(frozen=True)
class StagedTensors:
    """Phase 2 of `StateDictExport`: host views of the step's tensors (valid while the lease is held)."""

    tensors: dict[str, torch.Tensor]
    base_hf_dir: str | None
    max_shard_bytes: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def write(self, dest: str, storage_options: dict[str, Any] | None = None) -> WriteResult:
        plan = [TensorSpec.of(n, self.tensors[n]) for n in self.tensors]
        return write_snapshot(
            self.tensors.items(), dest, plan=plan, base_hf_dir=self.base_hf_dir,
            max_shard_bytes=self.max_shard_bytes, storage_options=storage_options, metadata=self.metadata,
        )


class StateDictExport:
    def __init__(
        self,
        source: torch.nn.Module | Mapping[str, torch.Tensor] | NamedTensors,
        base_hf_dir: str | None = None,
        *,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = 2 << 30,
        metadata: dict[str, Any] | Callable[[int], dict[str, Any]] | None = None,
    ) -> None:
        self.source, self.base_hf_dir, self.dtype = source, base_hf_dir, dtype
        self.max_shard_bytes, self.metadata = max_shard_bytes, metadata

    def stage(self, step: int, pool: HostStaging) -> StagedTensors:
        items = _named(self.source)
        dtypes = {n: self.dtype for n, t in items if self.dtype is not None and t.dtype.is_floating_point}
        host = pool.stage(items, dtypes)
        meta = self.metadata(step) if callable(self.metadata) else dict(self.metadata or {})
        return StagedTensors(host, self.base_hf_dir, self.max_shard_bytes, {**meta, "step": step})


@dataclass(frozen=True)
class StagedAdapter:
    """Phase 2 of `LoraExport`."""

    tensors: dict[str, torch.Tensor]
    config: bytes

    def write(self, dest: str, storage_options: dict[str, Any] | None = None) -> str:
        return write_adapter_tensors(self.tensors, self.config, dest, storage_options=storage_options)


class LoraExport:
    def __init__(self, tensors: Mapping[str, torch.Tensor] | NamedTensors, config: dict[str, Any]) -> None:
        self.tensors, self.config = tensors, config

    @classmethod
    def from_peft(cls, model: Any, adapter_name: str = "default") -> LoraExport:
        """The adapter `adapter_name` of a PEFT model, read afresh at every export."""
        from peft import get_peft_model_state_dict  # peft: only for a PEFT model

        def tensors() -> Iterable[tuple[str, torch.Tensor]]:
            return get_peft_model_state_dict(model, adapter_name=adapter_name).items()

        return cls(tensors, model.peft_config[adapter_name].to_dict())

    def stage(self, step: int, pool: HostStaging) -> StagedAdapter:
        host = pool.stage(_named(self.tensors))
        config = json.dumps(self.config, indent=2, sort_keys=True, default=_jsonable).encode()
        return StagedAdapter(host, config)


def _jsonable(value: object) -> object:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)
