"""Two-phase collective export: every rank's part is off the device when the collective returns;
rank 0 converts and writes in the background (no Prefect).

`collective_stage(source, pool=..., ...)` is called by **every rank** of `group`, with the same
arguments as `collective.collective_export` minus `dest`. Contract:
- rank 0 (the writer) passes `pool`, its `HostStaging` (`EvalClient.host_staging`); it first takes
  the pool's lease (`wait=True`: until the previous snapshot of this pool is written; `wait=False`:
  not at all) and broadcasts the decision, so when the lease is busy and not waited for every rank
  returns `skipped="export_busy"` before any data moves, and nothing is allocated;
- then the collective of `collective_export` (header check, TP gathers bucket by bucket, END,
  barrier in `finally`, rank 0's outcome broadcast): rank 0 copies each merged full tensor into its
  staging buffer and synchronises once before the barrier; other ranks only take part in the
  gathers. When the call returns on any rank, no rank needs its device tensors any more;
- rank 0 returns a `StagedCollective` whose `write(dest)` runs the plan, the converter and
  `write_snapshot` from the host buffer (hand it to `EvalClient.dispatch(step, export=staged)`:
  written in the client's background thread, the lease released after it, the point requested
  after the marker); the other ranks return a `StagedCollective` with `ok` and `error` (rank 0's
  failure, as text) and nothing to write;
- a rank-0 failure while staging releases the lease and re-raises on rank 0; the others return
  `ok=False` (never hang). A failure of the background write is rank 0's alone (no collective),
  reported by the client as that step's `export_failed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pinned_eval.snapshot.collective import (
    DEFAULT_BUCKET_BYTES,
    Converter,
    Merge,
    NamedTensors,
    SourceSpecs,
    _full_shape,
    _identity,
    _Local,
    _locals,
    _Protocol,
    merge_partitions,
)
from pinned_eval.snapshot.host_staging import HostStaging
from pinned_eval.snapshot.writer import TensorSpec, WriteResult, write_snapshot

BUSY = "export_busy"


@dataclass
class StagedCollective:
    ok: bool
    rank: int
    error: str | None = None
    skipped: str | None = None  # "export_busy": the writer's buffer was still being written
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0: host views, source names
    sources: SourceSpecs = field(default_factory=list)
    converter: Converter = _identity
    plan: list[TensorSpec] | Callable[[SourceSpecs], list[TensorSpec]] | None = None
    base_hf_dir: str | None = None
    max_shard_bytes: int | None = None
    metadata: dict[str, Any] | None = None
    pool: HostStaging | None = None

    def write(self, dest: str, storage_options: dict[str, Any] | None = None) -> WriteResult:
        """Phase 2 on the writer rank: plan, convert and write from the host buffer (marker last)."""
        if self.pool is None or not self.ok:
            raise RuntimeError(f"rank {self.rank} holds nothing to write (only the writer rank does)")
        specs = self.plan(self.sources) if callable(self.plan) else self.plan

        def stream() -> Any:
            for name, t in self.tensors.items():
                yield from self.converter(name, t)

        kwargs: dict[str, Any] = {} if self.max_shard_bytes is None else {"max_shard_bytes": self.max_shard_bytes}
        return write_snapshot(stream(), dest, plan=specs, base_hf_dir=self.base_hf_dir,
                              storage_options=storage_options, metadata=self.metadata, **kwargs)

    def discard(self) -> None:
        """Hand the buffer back without writing (the point was not requested)."""
        if self.pool is not None and self.ok:
            self.pool.release()
            self.pool = None


def _stage_rank0(p: _Protocol, mine: list[_Local], pool: HostStaging, merge: Merge, bucket_bytes: int) -> dict[
    str, torch.Tensor
]:
    views = pool.views([(x.name, tuple(_full_shape(x, p.tp_size)), x.tensor.dtype) for x in mine])
    for bucket in p.buckets(mine, bucket_bytes):
        p.bcast(len(bucket))
        # the whole bucket's gathers first, merges after: a failing merge never leaves a peer
        # waiting in a gather of this bucket
        parts = [_gather_parts(p, x) for x in bucket]
        for x, got in zip(bucket, parts, strict=True):
            pool.copy(views[x.name], merge(x.name, got, x.dim, x.stride) if len(got) > 1 else got[0])
        del parts
    pool.synchronize()  # every byte on the host before the collective returns
    return views


def _gather_parts(p: _Protocol, x: _Local) -> list[torch.Tensor]:
    if not (x.tp and p.needs_gather):
        return [x.tensor]
    parts = [torch.empty_like(x.tensor) for _ in range(p.tp_size)]
    dist.all_gather(parts, x.tensor.contiguous(), group=p.tp_group)
    return parts


def _follow(p: _Protocol, mine: list[_Local]) -> None:
    pos = 0
    while True:
        msg = p.bcast()
        if msg == "end":
            p.open = False
            return
        for x in mine[pos : pos + int(msg)]:
            p.gather(x, None)
        pos += int(msg)


def collective_stage(
    source: torch.nn.Module | Callable[[], NamedTensors],
    *,
    pool: HostStaging | None,
    wait: bool = True,
    base_hf_dir: str | None = None,
    converter: Converter | None = None,
    merge: Merge = merge_partitions,
    plan: list[TensorSpec] | Callable[[SourceSpecs], list[TensorSpec]] | None = None,
    group: Any = None,
    tp_group: Any = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    max_shard_bytes: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> StagedCollective:
    """Stage on every rank of `group` (see the module docstring); rank 0 must pass `pool`."""
    if not dist.is_initialized():
        raise RuntimeError("collective_stage needs an initialised torch.distributed process group")
    p = _Protocol(group, tp_group)
    if p.rank == 0 and pool is None:
        raise ValueError("pool: the writer rank (rank 0 of the group) needs its HostStaging")
    mine = _locals(source)
    go = p.bcast(pool.acquire(wait=wait) if p.rank == 0 and pool is not None else None)
    if not go:
        p.open = False
        return StagedCollective(ok=False, rank=p.rank, skipped=BUSY)
    error: BaseException | None = None
    views: dict[str, torch.Tensor] = {}
    try:
        p.check_header(mine)
        if p.rank == 0 and pool is not None:
            views = _stage_rank0(p, mine, pool, merge, bucket_bytes)
        else:
            _follow(p, mine)
    except BaseException as exc:
        error = exc
        if p.rank == 0 and pool is not None:
            pool.release()
        raise
    finally:
        p.end()
        dist.barrier(group=group)
        outcome = p.bcast(None if error is None else f"{type(error).__name__}: {error}")
    if isinstance(outcome, str):
        return StagedCollective(ok=False, rank=p.rank, error=f"rank 0 failed: {outcome}")
    if p.rank != 0:
        return StagedCollective(ok=True, rank=p.rank)
    sources = [(x.name, _full_shape(x, p.tp_size), x.tensor.dtype) for x in mine]
    return StagedCollective(
        ok=True, rank=0, tensors=views, sources=sources, converter=converter or _identity, plan=plan,
        base_hf_dir=base_hf_dir, max_shard_bytes=max_shard_bytes, metadata=metadata, pool=pool,
    )
