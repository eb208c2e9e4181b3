"""Write named tensors as an HF snapshot, to a local directory or an `s3://` URL (one fsspec path).

Contract of `write_snapshot`:
1. a stale `.complete` at the destination is deleted before anything else is written, then
   what an earlier export left (top-level `*.safetensors`, the index, a `.retired` mark);
2. the shard plan (names, shapes, dtypes -> `model-0000i-of-0000N.safetensors`, greedy by a byte
   budget, an oversize tensor alone in its shard) is fixed up front: from `plan`, or from the
   tensors themselves when no plan is given (they are then materialised into a list);
3. tensors may arrive in any order; every planned tensor must arrive exactly once (duplicates,
   unplanned names, wrong shapes and missing tensors raise `SnapshotWriteError`); a tensor whose
   dtype differs from its planned dtype is cast to the planned dtype;
4. a shard is written once, as soon as all its planned tensors arrived, and its buffers dropped;
5. then the index (`metadata.total_size`, `metadata.export_id`, `weight_map`), then the config /
   tokenizer / chat-template / generation-config files of `base_hf_dir` (never its weights or
   index; `config.json` gets `dtype` and `torch_dtype` of the written weights); locally every
   file (each in the background once closed) and the directory are fsync'd; then `.complete`
   (a `Manifest`) strictly last;
6. on any failure every file this call wrote is removed (and the directory if this call made it).

Shards are streamed through `fs.open(..., "wb")` (to S3: `s3_upload.PartUpload`, 8 MiB parts with
10 in flight): a header built from the plan, then each tensor's bytes as a zero-copy memoryview.
Measured on 512 MiB of bf16 (ext4, page cache): 4.2 GiB/s, the same as
`safetensors.torch.save_file` (4.4 GiB/s) and 10x faster than `save()` -> bytes -> write
(0.4 GiB/s); it needs no local temp copy for S3.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch
from fsspec import AbstractFileSystem

from pinned_eval.snapshot import s3_upload
from pinned_eval.snapshot.errors import ExportError, make_export_dirs
from pinned_eval.snapshot.layout import (
    EXPORT_ID_KEY,
    INDEX,
    MARKER,
    RETIRED,
    SINGLE_FILE,
    Manifest,
    fsync_path,
    is_local,
    is_s3,
    is_weight_file,
    join,
    resolve,
    shard_name,
    to_url,
)

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


class SnapshotWriteError(ExportError, ValueError):
    """The tensors handed to the writer do not match its plan (names the offending tensor)."""


@dataclass(frozen=True)
class TensorSpec:
    """One planned tensor: HF name, shape and the dtype it is written in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise SnapshotWriteError(f"tensor {self.name!r}: dtype {self.dtype} has no safetensors code")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(t.shape), t.dtype)


@dataclass(frozen=True)
class WriteResult:
    path: str  # local path or s3:// URL of the snapshot directory
    bytes: int  # bytes of every file written (shards, index, metadata files, marker)
    seconds: float
    shards: int


def plan_shards(plan: list[TensorSpec], max_shard_bytes: int) -> dict[str, str]:
    """name -> shard file name; greedy in plan order like huggingface_hub's splitter."""
    if max_shard_bytes <= 0:
        raise SnapshotWriteError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    groups: list[list[str]] = []
    cur: list[str] = []
    cur_bytes = 0
    seen: set[str] = set()
    for spec in plan:
        if spec.name in seen:
            raise SnapshotWriteError(f"tensor {spec.name!r} appears twice in the plan")
        seen.add(spec.name)
        if cur and cur_bytes + spec.nbytes > max_shard_bytes:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(spec.name)
        cur_bytes += spec.nbytes
    if cur:
        groups.append(cur)
    if not groups:
        raise SnapshotWriteError("the plan is empty: a snapshot needs at least one tensor")
    n = len(groups)
    return {name: shard_name(i + 1, n) for i, g in enumerate(groups) for name in g}


def _header(specs: list[TensorSpec], export_id: str) -> bytes:
    meta: dict[str, Any] = {"__metadata__": {"format": "pt", EXPORT_ID_KEY: export_id}}
    off = 0
    for s in specs:
        end = off + s.nbytes
        meta[s.name] = {"dtype": DTYPE_CODES[s.dtype], "shape": list(s.shape), "data_offsets": [off, end]}
        off += s.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class _Writer:
    def __init__(self, fs: AbstractFileSystem, root: str, export_id: str) -> None:
        self.fs, self.root, self.export_id = fs, root, export_id
        self.written: dict[str, int] = {}  # file name -> size, in write order
        self.local = is_local(fs)
        # locally, each closed file is fsync'd in the background while the next one is written
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="snapshot-fsync") if self.local else None
        self._flushes: list[Future[None]] = []

    def path(self, name: str) -> str:
        return join(self.fs, self.root, name)

    def write_shard(self, fname: str, specs: list[TensorSpec], tensors: dict[str, torch.Tensor]) -> None:
        # Largest element size first keeps every tensor naturally aligned (as safetensors does).
        specs = sorted(specs, key=lambda s: -torch.empty((), dtype=s.dtype).element_size())
        head = _header(specs, self.export_id)
        self.written[fname] = -1  # registered before opening: a failure mid-write still cleans it
        with self._open_stream(fname) as f:
            f.write(head)
            for s in specs:
                t = tensors[s.name]
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)  # zero-copy buffer
        self.written[fname] = len(head) + sum(s.nbytes for s in specs)
        self._flush_later(fname)

    def _open_stream(self, name: str) -> Any:
        """A shard's output: S3 gets the windowed multipart stream, anything else `fs.open`."""
        if is_s3(self.fs):
            return s3_upload.PartUpload(self.fs, self.path(name))
        return self.fs.open(self.path(name), "wb")

    def write_bytes(self, name: str, data: bytes, *, durable: bool = True) -> None:
        self.written[name] = -1
        with self.fs.open(self.path(name), "wb") as f:
            f.write(data)
        self.written[name] = len(data)
        if durable:
            self._flush_later(name)

    def _flush_later(self, name: str) -> None:
        if self._pool is not None:
            self._flushes.append(self._pool.submit(fsync_path, self.path(name)))

    def sync(self) -> None:
        """Make every durable file written so far and the directory durable (local only).

        Each file's fsync was started in the background when it was closed, so the flush of a
        shard overlaps the writing of the next (an fsync per shard in line halved throughput for
        4 x 256 MiB shards in bench/snapshot_io.py under load; one pass at the end left the
        device idle while writing); this waits for all of them (re-raising the first error),
        then fsyncs the directory.
        """
        if self._pool is None:
            return  # object stores: an object is durable once its PUT returned
        for flush in self._flushes:
            flush.result()
        fsync_path(self.root)

    def close(self) -> None:
        """Wait for background fsyncs and stop their threads; no fsync outlives the export."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _collect(
    tensors: Iterable[tuple[str, torch.Tensor]], specs: dict[str, TensorSpec], weight_map: dict[str, str],
    w: _Writer,
) -> None:
    remaining: dict[str, int] = {}
    for fname in weight_map.values():
        remaining[fname] = remaining.get(fname, 0) + 1
    buffers: dict[str, dict[str, torch.Tensor]] = {}
    arrived: set[str] = set()
    for name, t in tensors:
        spec = specs.get(name)
        if spec is None:
            raise SnapshotWriteError(f"tensor {name!r} is not in the plan")
        if name in arrived:
            raise SnapshotWriteError(f"tensor {name!r} arrived twice")
        if tuple(t.shape) != spec.shape:
            raise SnapshotWriteError(f"tensor {name!r}: shape {tuple(t.shape)} != planned {spec.shape}")
        arrived.add(name)
        t = t.detach().to(device="cpu", dtype=spec.dtype).contiguous()
        fname = weight_map[name]
        buffers.setdefault(fname, {})[name] = t
        remaining[fname] -= 1
        if remaining[fname] == 0:
            group = buffers.pop(fname)
            w.write_shard(fname, [specs[n] for n in group], group)
    missing = sorted(set(specs) - arrived)
    if missing:
        raise SnapshotWriteError(f"{len(missing)} planned tensors never arrived, e.g. {missing[:3]}")


def _copy_base_files(
    base_hf_dir: str, w: _Writer, dtype: torch.dtype | None, storage_options: dict[str, Any] | None
) -> None:
    bfs, base = resolve(base_hf_dir, storage_options if "://" in base_hf_dir else None)
    for info in bfs.ls(base, detail=True):
        fname = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if info["type"] != "file" or fname.startswith(".") or is_weight_file(fname):
            continue
        data = bfs.cat_file(info["name"])
        if fname == "config.json" and dtype is not None:
            cfg = json.loads(data)
            cfg["dtype"] = cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
            data = json.dumps(cfg, indent=2, sort_keys=True).encode() + b"\n"
        w.write_bytes(fname, data)


def _clear_stale(fs: AbstractFileSystem, root: str) -> None:
    """Marker first (readers stop trusting the dir), then what an earlier export left: weights,
    index, and staging's `.retired` mark (a re-export is in use again, not in the keep-ring)."""
    marker = join(fs, root, MARKER)
    if fs.exists(marker):
        fs.rm_file(marker)
    if not fs.isdir(root):
        return
    for info in fs.ls(root, detail=True):
        fname = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if info["type"] == "file" and (fname.endswith(".safetensors") or fname in (INDEX, SINGLE_FILE, RETIRED)):
            fs.rm_file(info["name"])


def write_snapshot(
    tensors: Iterable[tuple[str, torch.Tensor]],
    dest: str,
    *,
    plan: list[TensorSpec] | None = None,
    base_hf_dir: str | None = None,
    max_shard_bytes: int = 2 << 30,
    storage_options: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> WriteResult:
    """Write `tensors` as a complete HF snapshot at `dest` (see the module docstring)."""
    t0 = time.perf_counter()
    if plan is None:
        tensors = list(tensors)
        plan = [TensorSpec.of(n, t) for n, t in tensors]
    weight_map = plan_shards(plan, max_shard_bytes)
    specs = {s.name: s for s in plan}
    meta = json.loads(json.dumps(metadata or {}))  # must be JSON: fails here, before any write
    fs, root = resolve(dest, storage_options)
    export_id = uuid.uuid4().hex
    w = _Writer(fs, root, export_id)
    made_dir = not fs.exists(root)
    try:
        try:
            _clear_stale(fs, root)
            if is_local(fs):
                make_export_dirs(root)  # 0700, below trusted directories only
            _collect(tensors, specs, weight_map, w)
            total = sum(s.nbytes for s in plan)
            index = {"metadata": {"total_size": total, EXPORT_ID_KEY: export_id},
                     "weight_map": dict(sorted(weight_map.items()))}
            index_bytes = json.dumps(index, indent=2).encode() + b"\n"
            w.write_bytes(INDEX, index_bytes)
            if base_hf_dir is not None:
                float_dtypes = {s.dtype for s in plan if s.dtype.is_floating_point}
                dtype = float_dtypes.pop() if len(float_dtypes) == 1 else None
                _copy_base_files(base_hf_dir, w, dtype, storage_options)
            w.sync()  # every byte and entry above is durable before the marker can be
            manifest = Manifest(
                export_id=export_id, index_sha256=hashlib.sha256(index_bytes).hexdigest(), total_size=total,
                files=dict(w.written), created_at=datetime.now(UTC).isoformat(), metadata=meta,
            )
            # Not fsync'd: a marker lost in a crash only makes the snapshot read as incomplete.
            w.write_bytes(MARKER, manifest.model_dump_json(indent=2).encode(), durable=False)
        finally:
            w.close()  # no background fsync outlives the call, or races the removal below
    except BaseException:
        _remove_partial(fs, root, w, made_dir)
        raise
    return WriteResult(path=to_url(fs, root), bytes=sum(w.written.values()),
                       seconds=time.perf_counter() - t0, shards=len(set(weight_map.values())))


def _remove_partial(fs: AbstractFileSystem, root: str, w: _Writer, made_dir: bool) -> None:
    """Remove what this call wrote, marker first; never raise over the original error."""
    names = sorted(w.written, key=lambda n: n != MARKER)
    for name in names:
        with contextlib.suppress(OSError):
            fs.rm_file(w.path(name))
    if made_dir and is_local(fs):
        with contextlib.suppress(OSError):
            fs.rmdir(root)  # only if empty
