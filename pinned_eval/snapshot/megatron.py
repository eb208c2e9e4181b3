"""Megatron-core GPT (dense Llama / Qwen2 / Qwen3) → HF snapshot, live or from a checkpoint.

Two entry points, one converter (`mcore_names.MegatronToHf`) and one writer (`write_snapshot`):
- `export_live_model(model, base_hf_dir, dest)` — collective, inside a training job: every rank
  calls it; tensor-parallel shards are all-gathered (fc1 regrouped as SwiGLU [gate; up]), global
  rank 0 of `group` converts and writes (protocol in `pinned_eval.snapshot.collective`);
  `stage_live_model(model, base_hf_dir, pool=...)` is its two-phase form: the collective ends once
  every part is in rank 0's host buffer, conversion and writing follow in the background.
- `export_megatron_checkpoint(ckpt_dir, hf_base_dir, dest)` — offline, one process, no model and
  no megatron import: streams a `torch_dist` checkpoint one layer at a time (`mcore_checkpoint`).

Invariants (both paths):
- the HF layout comes from the base HF dir's `config.json` (family from `model_type` unless given);
  its config, tokenizer and chat template are copied into the snapshot, never its weights;
- the plan (every HF tensor, shape, dtype) is computed and checked against the architecture
  before any tensor data moves, and the writer enforces it: each tensor exactly once;
- tensors are written in the source dtype (bf16 training → bf16 snapshot);
- unsupported layouts (pipeline parallel > 1 live, virtual pipeline chunks, non-gated MLP,
  unknown tensors) raise a clear error instead of producing a partial snapshot.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pinned_eval.snapshot.collective import DEFAULT_BUCKET_BYTES, ExportResult, collective_export, merge_partitions
from pinned_eval.snapshot.collective_staged import StagedCollective, collective_stage
from pinned_eval.snapshot.errors import ConversionError
from pinned_eval.snapshot.host_staging import HostStaging
from pinned_eval.snapshot.layout import resolve
from pinned_eval.snapshot.mcore_checkpoint import TorchDistReader
from pinned_eval.snapshot.mcore_names import DenseLayout, MegatronToHf, plan_conversion
from pinned_eval.snapshot.writer import TensorSpec, WriteResult, write_snapshot

DEFAULT_MAX_SHARD_BYTES = 2 << 30


def read_hf_config(hf_base_dir: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The base HF directory's `config.json` (local path or URL)."""
    fs, root = resolve(hf_base_dir, storage_options if "://" in hf_base_dir else None)
    path = f"{root.rstrip('/')}/config.json"
    if not fs.exists(path):
        raise FileNotFoundError(f"hf_base_dir {hf_base_dir!r} has no config.json")
    cfg = json.loads(fs.cat_file(path))
    if not isinstance(cfg, dict):
        raise ConversionError(f"{hf_base_dir}/config.json is not a JSON object")
    return cfg


def _specs(planned: list[tuple[str, tuple[int, ...], torch.dtype]]) -> list[TensorSpec]:
    return [TensorSpec(n, s, d) for n, s, d in planned]


def export_megatron_checkpoint(
    ckpt_dir: str | Path,
    hf_base_dir: str,
    dest: str,
    *,
    family: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    storage_options: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> WriteResult:
    """Convert a torch_dist checkpoint (or a Megatron-LM save root: latest iteration) to an HF
    snapshot at `dest` (local path or `s3://`). Peak memory ≈ one layer tensor + one shard."""
    layout = DenseLayout.from_hf_config(read_hf_config(hf_base_dir, storage_options), family)
    reader = TorchDistReader(ckpt_dir)
    converter = MegatronToHf(layout, source_tied="output_layer.weight" not in reader.keys)
    plan = _specs(plan_conversion(converter, reader.entries()))

    def stream() -> Any:
        for name, t in reader.tensors():
            yield from converter.convert(name, t)

    meta = {"source": "megatron", "checkpoint": str(reader.path), "family": layout.family, **(metadata or {})}
    return write_snapshot(stream(), dest, plan=plan, base_hf_dir=hf_base_dir, max_shard_bytes=max_shard_bytes,
                          storage_options=storage_options, metadata=meta)


def _unwrap(model: Any) -> torch.nn.Module:
    if isinstance(model, list | tuple):
        if len(model) != 1:
            raise NotImplementedError(
                f"got {len(model)} model chunks (virtual pipeline parallelism); live export supports one"
            )
        model = model[0]
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
        inner = inner.module  # DDP, Float16Module
    if not hasattr(inner, "config") or not hasattr(inner, "share_embeddings_and_output_weights"):
        raise TypeError(f"{type(inner).__name__} is not a Megatron-core GPTModel")
    return inner


def _megatron_merge(name: str, shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    # Every rank holds [gate_r; up_r] of the SwiGLU fc1, whether or not its megatron-core version
    # marks the parameter with partition_stride=2 (0.16 does, older releases did not).
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        stride = 2
    return merge_partitions(name, shards, dim, stride)


def _live_parts(
    model: Any, base_hf_dir: str, family: str | None, tp_group: Any, storage_options: dict[str, Any] | None
) -> tuple[torch.nn.Module, Any, Any, Any]:
    """(module, tp group, plan, converter) of a live export; checks that fail on every rank raise here."""
    inner = _unwrap(model)
    if not getattr(inner.config, "gated_linear_unit", False):
        raise NotImplementedError("live export supports SwiGLU (gated_linear_unit=True) models only")
    from megatron.core import parallel_state  # megatron-core: optional extra, only for a live export

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron parallel state is not initialised (initialize_model_parallel)")
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("live export with pipeline parallelism > 1 is not supported; "
                                  "save a torch_dist checkpoint and use export_megatron_checkpoint")
    tp_group = tp_group or parallel_state.get_tensor_model_parallel_group()
    source_tied = bool(inner.share_embeddings_and_output_weights)
    state: dict[str, MegatronToHf] = {}

    def plan(full: list[tuple[str, torch.Size, torch.dtype]]) -> list[TensorSpec]:
        layout = DenseLayout.from_hf_config(read_hf_config(base_hf_dir, storage_options), family)
        state["converter"] = MegatronToHf(layout, source_tied=source_tied)
        return _specs(plan_conversion(state["converter"], full))

    def convert(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return state["converter"].convert(name, t)

    return inner, tp_group, plan, convert


def export_live_model(
    model: Any,
    base_hf_dir: str,
    dest: str,
    *,
    family: str | None = None,
    group: Any = None,
    tp_group: Any = None,
    bucket_bytes: int | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    storage_options: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> ExportResult:
    """Collective: every rank of `group` (default: world) calls this with its `GPTModel` (or a
    one-element list / DDP-wrapped model). Returns `pinned_eval.snapshot.collective.ExportResult` on
    every rank; raises on global rank 0 of `group` if it failed (the others then get ok=False).

    `tp_group` defaults to megatron's tensor-parallel group. Only rank 0 reads `base_hf_dir`.
    Checks that fail identically on every rank (layout, parallel state) raise before any collective.
    """
    inner, tp_group, plan, convert = _live_parts(model, base_hf_dir, family, tp_group, storage_options)
    meta = {"source": "megatron-live", **(metadata or {})}
    return collective_export(
        inner, dest, base_hf_dir=base_hf_dir, converter=convert, merge=_megatron_merge, plan=plan,
        group=group, tp_group=tp_group, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
        max_shard_bytes=max_shard_bytes, storage_options=storage_options, metadata=meta,
    )


def stage_live_model(
    model: Any,
    base_hf_dir: str,
    *,
    pool: HostStaging | None,
    wait: bool = True,
    family: str | None = None,
    group: Any = None,
    tp_group: Any = None,
    bucket_bytes: int | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    storage_options: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> StagedCollective:
    """Two-phase `export_live_model` (`pinned_eval.snapshot.collective_staged`): collective on every
    rank; returns once every rank's part is in rank 0's host buffer `pool` (`EvalClient.host_staging`;
    None on the other ranks). On rank 0 hand the result to `client.dispatch(step, export=staged)`:
    the HF conversion and the write run in the client's background thread."""
    inner, tp_group, plan, convert = _live_parts(model, base_hf_dir, family, tp_group, storage_options)
    return collective_stage(
        inner, pool=pool, wait=wait, base_hf_dir=base_hf_dir, converter=convert, merge=_megatron_merge,
        plan=plan, group=group, tp_group=tp_group, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
        max_shard_bytes=max_shard_bytes, metadata={"source": "megatron-live", **(metadata or {})},
    )
