"""Collective in-loop export of a live `torch.distributed` job to an HF snapshot (no Prefect).

`collective_export(source, dest, ...)` is called by **every rank** of `group`. Contract:
- each rank yields its local tensors in the same order with the same names (a model's
  `named_parameters()` does); tensors carrying Megatron's TP attributes
  (`tensor_model_parallel=True`, `partition_dim`, `partition_stride`) are all-gathered in
  `tp_group` and merged (`merge`), the rest are taken as they are (replicated);
- rank 0 of `group` converts each full tensor (`converter`) and writes through
  `pinned_eval.snapshot.writer.write_snapshot`; other ranks only take part in the gathers;
- protocol (all messages come from rank 0, so the collectives always line up):
  1. rank 0 broadcasts a header (name, local shape, TP attributes of every tensor); every rank
     compares it with its own and the verdict is all-reduced, so a rank iterating a different
     model fails everyone at once instead of hanging a gather;
  2. the writer pulls tensors lazily; for each bucket (≤ `bucket_bytes` gathered) rank 0
     broadcasts the bucket size, every rank gathers it, then rank 0 converts and yields it;
  3. rank 0 always broadcasts END, then all ranks meet at the barrier in `finally`, then rank 0
     broadcasts the outcome. So a rank-0 failure (convert, plan, storage) is seen by the other
     ranks at the next bucket boundary: rank 0 re-raises, the others return
     `ExportResult(ok=False, error=...)`. Only a failure *inside* a collective (a dead peer) can
     still block, bounded by the process group's timeout.
- the writer deletes a stale `.complete` first, writes `.complete` last and removes partial
  output on failure, so a failed export never looks complete.
Ranks whose TP group does not contain rank 0 (other data-parallel replicas) skip the gathers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pinned_eval.snapshot.errors import ExportError
from pinned_eval.snapshot.writer import TensorSpec, write_snapshot

NamedTensors = Iterable[tuple[str, torch.Tensor]]
Converter = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
Merge = Callable[[str, list[torch.Tensor], int, int], torch.Tensor]
SourceSpecs = list[tuple[str, torch.Size, torch.dtype]]

DEFAULT_BUCKET_BYTES = 512 << 20
_END = "end"


@dataclass(frozen=True)
class ExportResult:
    """Outcome of one collective export, returned on every rank (rank 0's view, broadcast)."""

    ok: bool
    path: str
    bytes: int
    seconds: float
    shards: int
    rank: int  # the rank this result was returned on
    error: str | None = None


class CollectiveExportError(ExportError, RuntimeError):
    """The ranks disagree on what to export (names, shapes or TP layout differ)."""


@dataclass(frozen=True)
class _Local:
    name: str
    tensor: torch.Tensor
    tp: bool
    dim: int
    stride: int

    def header(self) -> tuple[str, tuple[int, ...], bool, int, int]:
        return (self.name, tuple(self.tensor.shape), self.tp, self.dim, self.stride)

    def gathered_bytes(self, tp_size: int) -> int:
        return self.tensor.numel() * self.tensor.element_size() * (tp_size if self.tp else 1)


def merge_partitions(name: str, shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of Megatron's strided partitioning: each shard holds `stride` chunks along `dim`,
    chunk s of rank r is global chunk s·tp + r (stride 1 = plain concatenation)."""
    if len(shards) == 1:
        return shards[0]
    if stride == 1:
        return torch.cat(shards, dim=dim)
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


def _identity(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(name, t)]


def _locals(source: torch.nn.Module | Callable[[], NamedTensors]) -> list[_Local]:
    items = source.named_parameters() if isinstance(source, torch.nn.Module) else source()
    out = []
    for name, t in items:
        tp = bool(getattr(t, "tensor_model_parallel", False))
        out.append(_Local(name, t.detach(), tp, int(getattr(t, "partition_dim", 0)) if tp else 0,
                          int(getattr(t, "partition_stride", 1)) if tp else 1))
    return out


class _Protocol:
    """Message passing from rank 0 of `group`; see the module docstring."""

    def __init__(self, group: Any, tp_group: Any) -> None:
        self.group, self.tp_group = group, tp_group
        self.rank = dist.get_rank(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        tp_members = dist.get_process_group_ranks(tp_group) if tp_group is not None else [dist.get_rank()]
        self.needs_gather = self.tp_size > 1 and self.src in tp_members
        self.open = True  # False once END was sent/received or the header check failed
        # NCCL only reduces CUDA tensors; gloo takes CPU ones.
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def bcast(self, obj: Any = None) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def check_header(self, mine: list[_Local]) -> None:
        header = self.bcast([x.header() for x in mine] if self.rank == 0 else None)
        own = [x.header() for x in mine]
        diff = next((i for i, (a, b) in enumerate(zip(header, own, strict=False)) if a != b), None)
        if diff is None and len(header) != len(own):
            diff = min(len(header), len(own))
        if self.agree(diff is None):
            return
        self.open = False
        mine_report = None
        if diff is not None:
            theirs = header[diff] if diff < len(header) else "nothing"
            ours = own[diff] if diff < len(own) else "nothing"
            mine_report = f"rank {dist.get_rank()} differs at tensor #{diff}: rank 0 has {theirs}, " \
                          f"it has {ours}"
        reports: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(reports, mine_report, group=self.group)
        raise CollectiveExportError("ranks disagree on the tensors to export: "
                                    + "; ".join(r for r in reports if r))

    def gather(self, x: _Local, merge: Merge | None) -> torch.Tensor:
        """All-gather `x` in the TP group; merge the shards where `merge` is given (rank 0)."""
        if not (x.tp and self.needs_gather):
            return x.tensor
        parts = [torch.empty_like(x.tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.tensor.contiguous(), group=self.tp_group)
        return merge(x.name, parts, x.dim, x.stride) if merge is not None else parts[0]

    def buckets(self, mine: list[_Local], bucket_bytes: int) -> list[list[_Local]]:
        out: list[list[_Local]] = []
        cur: list[_Local] = []
        size = 0
        for x in mine:
            b = x.gathered_bytes(self.tp_size)
            if cur and size + b > bucket_bytes:
                out.append(cur)
                cur, size = [], 0
            cur.append(x)
            size += b
        return [*out, cur] if cur else out

    def end(self) -> None:
        if self.open and self.rank == 0:
            self.bcast(_END)
        self.open = False


def _rank0_stream(p: _Protocol, mine: list[_Local], converter: Converter, merge: Merge,
                  bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in p.buckets(mine, bucket_bytes):
        p.bcast(len(bucket))
        full = [p.gather(x, merge) for x in bucket]  # whole bucket first: peers never wait mid-bucket
        for x, t in zip(bucket, full, strict=True):
            for hf_name, hf_t in converter(x.name, t):
                yield hf_name, hf_t.detach().to("cpu")
        del full


def _follow(p: _Protocol, mine: list[_Local]) -> None:
    pos = 0
    while True:
        msg = p.bcast()
        if msg == _END:
            p.open = False
            return
        for x in mine[pos: pos + int(msg)]:
            p.gather(x, None)
        pos += int(msg)


def collective_export(
    source: torch.nn.Module | Callable[[], NamedTensors],
    dest: str,
    *,
    base_hf_dir: str | None = None,
    converter: Converter | None = None,
    merge: Merge = merge_partitions,
    plan: list[TensorSpec] | Callable[[SourceSpecs], list[TensorSpec]] | None = None,
    group: Any = None,
    tp_group: Any = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    max_shard_bytes: int | None = None,
    storage_options: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> ExportResult:
    """Export on every rank of `group` (see the module docstring); rank 0 writes `dest`.

    `source` is a module (its `named_parameters()`) or a callable returning (name, local tensor)
    pairs. `plan` is the writer's plan, or a callable that builds it on rank 0 from the full
    (name, shape, dtype) of every source tensor, before any data moves. Returns on every rank;
    raises on rank 0 when rank 0 failed.
    """
    t0 = time.perf_counter()
    if not dist.is_initialized():
        raise RuntimeError("collective_export needs an initialised torch.distributed process group")
    p = _Protocol(group, tp_group)
    mine = _locals(source)
    conv = converter or _identity
    error: BaseException | None = None
    result = None
    try:
        p.check_header(mine)
        if p.rank == 0:
            specs: list[TensorSpec] | None
            if callable(plan):
                specs = plan([(x.name, _full_shape(x, p.tp_size), x.tensor.dtype) for x in mine])
            else:
                specs = plan
            kwargs: dict[str, Any] = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
            result = write_snapshot(_rank0_stream(p, mine, conv, merge, bucket_bytes), dest, plan=specs,
                                    base_hf_dir=base_hf_dir, storage_options=storage_options,
                                    metadata=metadata, **kwargs)
        else:
            _follow(p, mine)
    except BaseException as exc:
        error = exc
        raise
    finally:
        p.end()
        dist.barrier(group=group)
        if p.rank == 0:
            outcome: Any = result if error is None else f"{type(error).__name__}: {error}"
            p.bcast(outcome)
        else:
            outcome = p.bcast()
    seconds = time.perf_counter() - t0
    if p.rank == 0 and result is not None:
        return ExportResult(True, result.path, result.bytes, seconds, result.shards, rank=0)
    if isinstance(outcome, str):
        return ExportResult(False, dest, 0, seconds, 0, rank=p.rank, error=f"rank 0 failed: {outcome}")
    return ExportResult(True, outcome.path, outcome.bytes, seconds, outcome.shards, rank=p.rank)


def _full_shape(x: _Local, tp_size: int) -> torch.Size:
    if not x.tp or tp_size == 1:
        return x.tensor.shape
    shape = list(x.tensor.shape)
    shape[x.dim] *= tp_size
    return torch.Size(shape)
