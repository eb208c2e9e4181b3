"""Is a snapshot complete? Header reads only, local or S3 through fsspec (ranged reads).

`check_snapshot` answers `complete=True` only when every one of these holds, checked in this order
(the first failure is reported as a typed `SnapshotProblem`):
1. `.complete` exists (`missing_marker`; waived by `require_marker=False` for base checkpoints);
2. the index exists and parses (`missing_index`, `bad_index`); a snapshot with a single
   `model.safetensors` and no index is read as one shard;
3. every shard named by the index exists (`missing_shard`); its 8-byte length and JSON header
   parse and describe contiguous tensors, and `__metadata__` maps keys to strings only, as
   safetensors' loaders require (`bad_header`, naming the key); file size == 8 + header + data end
   (`truncated_shard` when shorter, `shard_size_mismatch` when longer); the header's tensor names
   equal the index names mapped to that shard (`header_mismatch`);
4. tensor dtypes agree with `config.json` (`dtype_mismatch`, naming shard, tensor and both
   dtypes): when the config's `torch_dtype` (or `dtype`) is a floating type, every tensor must be
   floating point (F64, F32, F16, BF16, F8_E4M3, F8_E5M2); a BOOL or integer tensor is refused.
   Floating tensors of another width than the config's are accepted: real checkpoints mix them
   legitimately (F32 norms, router biases or FP8 scales in a bf16 model, FP8 weights with F32
   scales) and transformers casts on load. Not checked: a config with `quantization_config`
   (quantized weights are integers by design), a non-float or absent dtype, no or an unreadable
   `config.json` (an adapter has none);
5. the sum of tensor bytes equals `metadata.total_size` (`total_size_mismatch`);
6. the marker vouches for these files (`stale_marker`): a `Manifest` marker must carry the export
   id found in the index and every shard header, the index's sha256, and every listed file's size
   (`missing_file` when one is gone; `bad_marker` when it is not a manifest). A bare (empty)
   marker, as miles writes, cannot name an export: it is stale when older than any shard/index.

A PEFT LoRA adapter snapshot (`adapter=True`, or auto-detected by `adapter_config.json`) gets the
same checks with `adapter_model.safetensors` (or `adapter_model.safetensors.index.json`) in the
roles of the single file and the index, and `adapter_config.json` must exist (`missing_file`).

It never raises on corrupt content (only on I/O errors of the store itself) and reads no tensor data.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from fsspec import AbstractFileSystem
from pydantic import ValidationError

from pinned_eval.snapshot.layout import (
    ADAPTER_CONFIG,
    ADAPTER_INDEX,
    ADAPTER_WEIGHTS,
    EXPORT_ID_KEY,
    INDEX,
    MARKER,
    SINGLE_FILE,
    Index,
    Manifest,
    file_mtime,
    join,
    resolve,
    to_url,
)

DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
_TORCH_FLOATS = frozenset({"float64", "double", "float32", "float", "float16", "half", "bfloat16",
                           "float8_e4m3fn", "float8_e5m2"})
CONFIG = "config.json"
MAX_CONFIG = 1 << 20
MAX_HEADER = 100_000_000  # safetensors' own limit
PREFETCH = 64 << 10  # one ranged read per shard covers the header of any ordinary LLM shard


class SnapshotProblem(StrEnum):
    MISSING_MARKER = "missing_marker"
    MISSING_INDEX = "missing_index"
    BAD_INDEX = "bad_index"
    MISSING_SHARD = "missing_shard"
    BAD_HEADER = "bad_header"
    TRUNCATED_SHARD = "truncated_shard"
    SHARD_SIZE_MISMATCH = "shard_size_mismatch"
    HEADER_MISMATCH = "header_mismatch"
    DTYPE_MISMATCH = "dtype_mismatch"
    TOTAL_SIZE_MISMATCH = "total_size_mismatch"
    BAD_MARKER = "bad_marker"
    MISSING_FILE = "missing_file"
    STALE_MARKER = "stale_marker"


P = SnapshotProblem


@dataclass(frozen=True)
class SnapshotCheck:
    path: str
    complete: bool
    problem: SnapshotProblem | None
    detail: str
    total_size: int | None = None  # tensor bytes, when the index parsed
    shards: int | None = None


class _Incomplete(Exception):
    """Internal control flow: the first problem found; never escapes this module."""

    def __init__(self, problem: SnapshotProblem, detail: str) -> None:
        self.problem, self.detail = problem, detail


@dataclass(frozen=True)
class _Header:
    names: set[str]
    data_bytes: int
    export_id: str | None
    dtypes: dict[str, str]


def _parse_header(fname: str, raw: bytes) -> tuple[_Header, int]:
    """Validate a safetensors JSON header; return it and the end of its data section."""
    def bad(why: str) -> _Incomplete:
        return _Incomplete(P.BAD_HEADER, f"{fname}: {why}")
    try:
        hdr = json.loads(raw)
    except (ValueError, RecursionError) as e:  # deep nesting exhausts the stdlib parser's stack
        raise bad(f"header is not JSON ({e})") from None
    if not isinstance(hdr, dict):
        raise bad("header is not a JSON object")
    meta = hdr.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise bad(f"__metadata__ is not an object (a {type(meta).__name__})")
    for key, value in meta.items():  # safetensors' own loaders refuse anything but strings here
        if not isinstance(value, str):
            raise bad(f"__metadata__ key {key!r}: value is a {type(value).__name__}, not a string")
    if meta.get("format", "pt") != "pt":  # transformers loads only PyTorch-format safetensors
        raise bad(f"__metadata__ format {meta.get('format')!r} is not 'pt'")
    spans: list[tuple[int, int, str]] = []
    dtypes: dict[str, str] = {}
    for name, entry in hdr.items():
        if not isinstance(entry, dict):
            raise bad(f"entry {name!r} is not an object")
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise bad(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
            raise bad(f"tensor {name!r}: bad data_offsets {offs!r}")
        if offs[1] - offs[0] != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise bad(f"tensor {name!r}: data_offsets {offs} do not fit shape {shape} of {dtype}")
        spans.append((offs[0], offs[1], name))
        dtypes[name] = dtype
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise bad(f"tensor {name!r} starts at {begin}, expected {end} (gap or overlap)")
        end = stop
    export_id = meta.get(EXPORT_ID_KEY)
    return _Header(set(hdr), end, export_id if isinstance(export_id, str) else None, dtypes), end


def _prefetch(fs: AbstractFileSystem, paths: dict[str, str], sizes: dict[str, int]) -> dict[str, bytes]:
    """The first PREFETCH bytes of every shard in one batch (concurrent ranged GETs on S3)."""
    names = [n for n in paths if sizes[n] >= 8]
    if not names:
        return {}
    got = fs.cat_ranges([paths[n] for n in names], 0, [min(sizes[n], PREFETCH) for n in names], on_error="return")
    out = {}
    for name, data in zip(names, got, strict=True):
        if isinstance(data, FileNotFoundError):
            raise _Incomplete(P.MISSING_SHARD, f"{name}: vanished while checking")
        if isinstance(data, BaseException):
            raise data  # an I/O error of the store itself, not a verdict on the snapshot
        out[name] = data
    return out


def _read_shard_header(fs: AbstractFileSystem, path: str, fname: str, size: int, head: bytes) -> _Header:
    """Validate one shard from its prefetched head (reading the rest of a long header if needed)."""
    if size < 8:
        raise _Incomplete(P.TRUNCATED_SHARD, f"{fname}: {size} bytes, shorter than a header")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER:
        raise _Incomplete(P.BAD_HEADER, f"{fname}: header length {n} exceeds {MAX_HEADER}")
    if 8 + n > size:
        raise _Incomplete(P.TRUNCATED_SHARD, f"{fname}: header of {n} bytes, file {size} bytes")
    raw = head[8 : 8 + n]
    if len(raw) < n:
        try:
            raw += fs.cat_file(path, start=len(head), end=8 + n)
        except FileNotFoundError:
            raise _Incomplete(P.MISSING_SHARD, f"{fname}: vanished while checking") from None
    header, end = _parse_header(fname, raw)
    expected = 8 + n + end
    if size < expected:
        raise _Incomplete(P.TRUNCATED_SHARD, f"{fname}: size {size} < {expected} from its header")
    if size > expected:
        raise _Incomplete(P.SHARD_SIZE_MISMATCH, f"{fname}: size {size} > {expected} from its header")
    return header


def _listing(fs: AbstractFileSystem, root: str) -> dict[str, dict[str, Any]]:
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries if e["type"] == "file"}


def _check(fs: AbstractFileSystem, root: str, require_marker: bool, adapter: bool | None) -> tuple[int, int]:
    files = _listing(fs, root)
    if not files:
        raise _Incomplete(P.MISSING_MARKER, f"no snapshot files at {to_url(fs, root)}")
    if MARKER not in files and require_marker:
        raise _Incomplete(P.MISSING_MARKER, f"{MARKER} is missing")
    if adapter is None:
        adapter = ADAPTER_CONFIG in files
    index_name, single_name = (ADAPTER_INDEX, ADAPTER_WEIGHTS) if adapter else (INDEX, SINGLE_FILE)
    if adapter and ADAPTER_CONFIG not in files:
        raise _Incomplete(P.MISSING_FILE, f"{ADAPTER_CONFIG} is missing")

    index_bytes: bytes | None = None
    index_export_id: str | None = None
    headers: dict[str, _Header] = {}
    if index_name in files:
        index_bytes = fs.cat_file(join(fs, root, index_name))
        try:
            index = Index.model_validate_json(index_bytes)
        except ValidationError as e:
            raise _Incomplete(P.BAD_INDEX, f"{index_name}: {e.errors()[0]['msg']}") from None
        weight_map, total_size = index.weight_map, index.metadata.total_size
        index_export_id = index.metadata.export_id
        if not weight_map:
            raise _Incomplete(P.BAD_INDEX, f"{index_name}: weight_map is empty")
        bad_names = sorted({f for f in weight_map.values() if "/" in f or "\\" in f or f.startswith(".")})
        if bad_names:
            raise _Incomplete(P.BAD_INDEX, f"{index_name}: shard names outside the dir {bad_names[:3]}")
    elif single_name in files:
        path, size = join(fs, root, single_name), files[single_name]["size"]
        head = _prefetch(fs, {single_name: path}, {single_name: size}).get(single_name, b"")
        single = _read_shard_header(fs, path, single_name, size, head)
        weight_map = dict.fromkeys(single.names, single_name)
        total_size = single.data_bytes
        headers[single_name] = single
    elif adapter:
        raise _Incomplete(P.MISSING_SHARD, f"{single_name} is missing")
    else:
        raise _Incomplete(P.MISSING_INDEX, f"{index_name} is missing")

    shard_names = sorted(set(weight_map.values()))
    absent = [f for f in shard_names if f not in files]
    if absent:
        raise _Incomplete(P.MISSING_SHARD, f"{absent[0]} is missing" + (f" (and {len(absent) - 1} more)"
                                                                         if len(absent) > 1 else ""))
    todo = {f: join(fs, root, f) for f in shard_names if f not in headers}
    sizes = {f: files[f]["size"] for f in shard_names}
    heads = _prefetch(fs, todo, sizes)
    data_bytes = 0
    for fname in shard_names:
        if fname not in headers:
            headers[fname] = _read_shard_header(fs, todo[fname], fname, sizes[fname], heads.get(fname, b""))
        expected = {k for k, v in weight_map.items() if v == fname}
        got = headers[fname].names
        if got != expected:
            extra, missing = sorted(got - expected), sorted(expected - got)
            raise _Incomplete(P.HEADER_MISMATCH,
                              f"{fname}: not in index {extra[:3]}, missing from header {missing[:3]}")
        data_bytes += headers[fname].data_bytes
    _check_dtypes(fs, root, files, headers)
    if data_bytes != total_size:
        raise _Incomplete(P.TOTAL_SIZE_MISMATCH,
                          f"shards hold {data_bytes} tensor bytes, index says total_size {total_size}")

    if MARKER in files:
        _check_marker(fs, root, files, index_bytes, index_export_id, headers, index_name)
    return total_size, len(shard_names)


def _config_dtype(fs: AbstractFileSystem, root: str, files: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """(key, value) of the config's floating dtype, or None when there is none to check against."""
    if CONFIG not in files or files[CONFIG]["size"] > MAX_CONFIG:
        return None
    try:
        cfg = json.loads(fs.cat_file(join(fs, root, CONFIG)))
    except (ValueError, RecursionError):
        return None
    if not isinstance(cfg, dict) or cfg.get("quantization_config") is not None:
        return None
    for key in ("torch_dtype", "dtype"):
        value = cfg.get(key)
        if isinstance(value, str) and value.removeprefix("torch.") in _TORCH_FLOATS:
            return key, value
    return None


def _check_dtypes(fs: AbstractFileSystem, root: str, files: dict[str, dict[str, Any]],
                  headers: dict[str, _Header]) -> None:
    wanted = None
    for fname, h in sorted(headers.items()):
        for name, dtype in sorted(h.dtypes.items()):
            if dtype in FLOAT_DTYPES:
                continue
            wanted = wanted or _config_dtype(fs, root, files)
            if wanted is None:
                return
            key, value = wanted
            raise _Incomplete(P.DTYPE_MISMATCH, f"{fname}: tensor {name!r} is {dtype}, but {CONFIG} {key} is "
                                                f"{value}: a floating-point model holds floating-point tensors only")


def _check_marker(
    fs: AbstractFileSystem, root: str, files: dict[str, dict[str, Any]], index_bytes: bytes | None,
    index_export_id: str | None, headers: dict[str, _Header], index_name: str,
) -> None:
    raw = fs.cat_file(join(fs, root, MARKER)) if files[MARKER]["size"] else b""
    if not raw.strip():  # bare marker: only modification times can tell an old one
        marker_t = file_mtime(files[MARKER])
        newer = [f for f in [*headers, index_name] if f in files and file_mtime(files[f]) > marker_t]
        if newer:
            raise _Incomplete(P.STALE_MARKER, f"bare {MARKER} is older than {sorted(newer)[:3]}")
        return
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as e:
        raise _Incomplete(P.BAD_MARKER, f"{MARKER} is not a manifest: {e.errors()[0]['msg']}") from None
    stale = P.STALE_MARKER
    if index_bytes is not None and index_export_id != manifest.export_id:
        raise _Incomplete(stale, f"{MARKER} is for export {manifest.export_id}, index {index_export_id}")
    for fname, h in sorted(headers.items()):
        if h.export_id != manifest.export_id:
            raise _Incomplete(stale, f"{fname} is from export {h.export_id}, {MARKER} {manifest.export_id}")
    if index_bytes is not None and hashlib.sha256(index_bytes).hexdigest() != manifest.index_sha256:
        raise _Incomplete(stale, f"{index_name} changed after {MARKER} was written")
    for fname, size in sorted(manifest.files.items()):
        if fname not in files:
            raise _Incomplete(P.MISSING_FILE, f"{fname} listed in {MARKER} is missing")
        if files[fname]["size"] != size:
            raise _Incomplete(stale, f"{fname}: {files[fname]['size']} bytes, {MARKER} says {size}")


def check_snapshot(
    path_or_url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    require_marker: bool = True,
    adapter: bool | None = None,
) -> SnapshotCheck:
    """Check one snapshot directory (local path or `s3://bucket/prefix`); see the module docstring.

    `require_marker=False` is for a base checkpoint saved without `.complete` (e.g. by
    `save_pretrained`): every structural check still runs; a marker that exists is still checked.
    `adapter=True` checks a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors` or
    its index), `False` a full model; None decides by the presence of `adapter_config.json`.
    """
    fs, root = resolve(path_or_url, storage_options)
    url = to_url(fs, root)
    try:
        total, shards = _check(fs, root, require_marker, adapter)
    except _Incomplete as e:
        return SnapshotCheck(url, False, e.problem, e.detail)
    return SnapshotCheck(url, True, None, f"complete: {shards} shards, {total} tensor bytes", total, shards)
