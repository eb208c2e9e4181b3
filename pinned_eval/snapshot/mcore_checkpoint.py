"""Bounded-memory reader of a Megatron-core `torch_dist` checkpoint (no megatron, no process group).

A `torch_dist` checkpoint is a `torch.distributed.checkpoint` directory (`.metadata`,
`__R_T.distcp`, `common.pt`, `metadata.json`). Its global tensors are TP-independent, and the
transformer layers are stacked on a leading axis under `decoder.layers.<rest>` (no index).

Invariants:
- only model tensors are read (`embedding.`, `decoder.`, `output_layer.`); optimizer state,
  RNG state and byte entries (`_extra_state`) are ignored;
- stacked keys are read one layer at a time (Megatron stores one chunk per layer and TP rank),
  so peak memory is one layer's tensor, not the stacked tensor; a key whose stored chunks span
  several layers is read whole and unstacked;
- `tensors()` yields in model order (embedding, layer 0 … L-1, then the rest), each tensor
  named like a live model's parameter (`decoder.layers.<i>.<rest>`);
- the metadata file is read once per reader;
- nothing is read through a symlink that leaves the checkpoint: a `.metadata` (a pickle), a
  tracker, an `iter_*` directory or a shard resolving outside the directory given is refused
  before anything is opened (the flow confines that directory to the source roots).
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from pinned_eval.snapshot.errors import ConversionError
from pinned_eval.snapshot.mcore_names import MODEL_PREFIXES
from pinned_eval.source_roots import within

_STACKED = "decoder.layers."
_INDEXED = re.compile(r"^decoder\.layers\.\d+\.")


class CheckpointNotFound(FileNotFoundError):
    """The path is neither a torch_dist checkpoint nor a Megatron-LM save directory."""


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A torch_dist directory itself, or a Megatron-LM save root (`latest_checkpointed_iteration.txt`
    → `iter_XXXXXXX` or `release`)."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return _contained(p, p)
    tracker = p / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        it = _contained(tracker, p).read_text().strip()
        sub = p / ("release" if it == "release" else f"iter_{int(it):07d}")
        if (sub / ".metadata").is_file():
            return _contained(sub, p)
        raise CheckpointNotFound(f"{tracker} names {sub.name}, which has no torch_dist .metadata")
    raise CheckpointNotFound(
        f"{p} is not a torch_dist checkpoint (no .metadata, no latest_checkpointed_iteration.txt)"
    )


def _contained(path: Path, top: Path) -> Path:
    """`path` when it and (a directory) every entry in it resolve inside `top`; else refused."""
    for entry in [path, *(path.iterdir() if path.is_dir() else [])]:
        if not within(str(entry), str(top)):
            raise CheckpointNotFound(f"{entry} resolves outside the checkpoint {top} (a symlink); refused unread")
    return path


class _RegionPlanner(LoadPlanner):
    """Loads one region (offsets, sizes) of one checkpoint tensor into a preallocated buffer."""

    def __init__(
        self, fqn: str, md: TensorStorageMetadata, offsets: tuple[int, ...], out: torch.Tensor
    ) -> None:
        self.fqn, self.md, self.offsets, self.out = fqn, md, offsets, out

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.out.shape)
        return LoadPlan(create_read_items_for_chunk_list(self.fqn, self.md, [chunk]))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise TypeError(f"{self.fqn}: unexpected byte entry in a tensor read")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.out
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            t = t.narrow(dim, off, length)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class TorchDistReader:
    """Streams the model tensors of one torch_dist checkpoint; see the module docstring."""

    def __init__(self, ckpt_dir: str | Path) -> None:
        self.path = resolve_checkpoint_dir(ckpt_dir)
        self._reader = FileSystemReader(str(self.path))
        md = self._reader.read_metadata()
        self._reader.set_up_storage_reader(md, is_coordinator=True)
        self.keys: dict[str, TensorStorageMetadata] = {
            k: v for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and k.startswith(MODEL_PREFIXES)
        }
        if not self.keys:
            raise CheckpointNotFound(f"{self.path} holds no model tensors ({', '.join(MODEL_PREFIXES)})")
        self.stacked = sorted(k for k in self.keys if k.startswith(_STACKED) and not _INDEXED.match(k))
        depths = {self.keys[k].size[0] for k in self.stacked}
        if len(depths) > 1:
            raise ConversionError(f"stacked layer keys disagree on the number of layers: {sorted(depths)}")
        self.num_layers = depths.pop() if depths else 0
        plain = [k for k in self.keys if k not in self.stacked]
        self.plain_first = sorted(k for k in plain if k.startswith("embedding."))
        self.plain_last = sorted(k for k in plain if not k.startswith("embedding."))

    def entries(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        """(name, shape, dtype) of every tensor `tensors()` yields, in the same order."""
        out = [(k, self.keys[k].size, self.keys[k].properties.dtype) for k in self.plain_first]
        for i in range(self.num_layers):
            for k in self.stacked:
                md = self.keys[k]
                out.append((_layer_name(k, i), torch.Size(md.size[1:]), md.properties.dtype))
        out += [(k, self.keys[k].size, self.keys[k].properties.dtype) for k in self.plain_last]
        return out

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """One tensor, or one layer of a stacked one (leading axis dropped)."""
        md = self.keys[key]
        if layer is None:
            return self._region(key, (0,) * len(md.size), tuple(md.size))
        region = self._region(key, (layer,) + (0,) * (len(md.size) - 1), (1, *md.size[1:]))
        return region[0]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for k in self.plain_first:
            yield k, self.read(k)
        whole = {k: self.read(k) for k in self.stacked if self.spans_layers(k)}
        for i in range(self.num_layers):
            for k in self.stacked:
                yield _layer_name(k, i), (whole[k][i] if k in whole else self.read(k, i))
        for k in self.plain_last:
            yield k, self.read(k)

    def spans_layers(self, key: str) -> bool:
        """True when a stored chunk of the stacked `key` covers more than one layer."""
        return any(c.sizes[0] > 1 for c in self.keys[key].chunks)

    def _region(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        md = self.keys[key]
        out = torch.empty(sizes, dtype=md.properties.dtype)
        planner = _RegionPlanner(key, md, offsets, out)
        plan = self._reader.prepare_local_plan(planner.create_local_plan())
        covered = sum(torch.Size(item.lengths).numel() for item in plan.items)
        if covered != out.numel():
            raise ConversionError(f"{self.path}: stored chunks of {key} cover {covered} of {out.numel()} elements")
        self._reader.read_data(plan, planner).wait()
        return out


def _layer_name(stacked_key: str, layer: int) -> str:
    return f"{_STACKED}{layer}.{stacked_key[len(_STACKED):]}"
