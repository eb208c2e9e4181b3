"""`check_snapshot` (pinned_eval/snapshot/check.py): the exact `SnapshotCheck` for every rule and boundary.

Each test builds a real snapshot on disk (the project's writer, `safetensors`, or hand-made
safetensors bytes), breaks one thing, and asserts the whole result: path, verdict, problem,
detail text, sizes. Boundaries are pinned on both sides (8-byte files, MAX_HEADER, the PREFETCH
read, data_offsets gaps and overlaps, equal mtimes, "(and N more)", lists cut to three names).
The bytes read are pinned too (the checker reads headers only) through `_ObservedFS`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import save_file

from pinned_eval.snapshot.check import DTYPE_SIZES, MAX_HEADER, PREFETCH, SnapshotCheck, SnapshotProblem, check_snapshot
from pinned_eval.snapshot.layout import (
    ADAPTER_CONFIG,
    ADAPTER_INDEX,
    ADAPTER_WEIGHTS,
    EXPORT_ID_KEY,
    INDEX,
    MARKER,
    SINGLE_FILE,
    Manifest,
)
from pinned_eval.snapshot.writer import write_snapshot
from tests.snapshot_fixtures import named_tensors

P = SnapshotProblem
S1, S2, S3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
TOTAL = sum(t.numel() * t.element_size() for _, t in named_tensors())  # 73887
NOTES = "notes_X"  # a non-weight file whose name ends in 'X': the listing strips only a trailing '/'


class _ObservedFS(LocalFileSystem):
    """The local filesystem, logging every read as (file name, start, end), and losing a file after
    `vanish[name]` reads of it (another process deleting it mid-check). A plain local filesystem can
    show neither which byte ranges were read nor a file vanishing between the listing and a read,
    hence this subclass; the reads and the deletion are real."""

    protocol = ("observed",)
    cachable = False

    def __init__(self, log: list | None = None, vanish: dict[str, int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log = log if log is not None else []
        self.vanish = dict(vanish or {})

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        name = path.rsplit("/", 1)[-1]
        self.log.append((name, start, end))
        if name in self.vanish:
            if self.vanish[name] == 0 and os.path.exists(path):
                os.remove(path)
            self.vanish[name] -= 1
        return super().cat_file(path, start, end, **kwargs)


fsspec.register_implementation("observed", _ObservedFS, clobber=True)


def _observed(d: Path, **options: Any) -> tuple[SnapshotCheck, list]:
    log: list = []
    return check_snapshot(f"observed://{d}", {"log": log, **options}), log


# ---- builders -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("base")
    (base / "config.json").write_text('{"model_type": "llama"}')
    (base / NOTES).write_text("listed in the manifest")
    d = tmp_path_factory.mktemp("tpl") / "snap"
    write_snapshot(named_tensors(), str(d), max_shard_bytes=30_000, base_hf_dir=str(base))
    return d


@pytest.fixture
def snap(template: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "snap"))


def _complete(d: Path | str, total: int, shards: int) -> SnapshotCheck:
    return SnapshotCheck(str(d), True, None, f"complete: {shards} shards, {total} tensor bytes", total, shards)


def _failed(d: Path | str, problem: SnapshotProblem, detail: str) -> SnapshotCheck:
    return SnapshotCheck(str(d), False, problem, detail)


def _size(p: Path) -> int:
    return p.stat().st_size


def _edit_index(d: Path, fn) -> None:
    index = json.loads((d / INDEX).read_text())
    fn(index)
    (d / INDEX).write_text(json.dumps(index))


def _export_id(d: Path) -> str:
    return json.loads((d / MARKER).read_text())["export_id"]


def _blob(header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """safetensors bytes: 8-byte length, the JSON header (space-padded to `length`), then `data`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    if length is not None:
        raw += b" " * (length - len(raw))
    return struct.pack("<Q", len(raw)) + raw + data


def _single(d: Path, blob: bytes, name: str = SINGLE_FILE) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(blob)
    return d


def _f32(n: int, begin: int = 0) -> dict:
    return {"dtype": "F32", "shape": [n], "data_offsets": [begin, begin + 4 * n]}


def _manifest(export_id: str, files: dict[str, int], total: int) -> bytes:
    return Manifest(export_id=export_id, index_sha256=hashlib.sha256(b"").hexdigest(), total_size=total,
                    files=files, created_at="2026-01-01T00:00:00+00:00").model_dump_json().encode()


def _set_mtimes(d: Path, ns: dict[str, int]) -> None:
    for name, t in ns.items():
        os.utime(d / name, ns=(t, t))


# ---- complete snapshots ---------------------------------------------------------------------------

def test_a_written_snapshot_is_complete_and_only_headers_are_read(snap: Path) -> None:
    assert check_snapshot(str(snap)) == _complete(snap, TOTAL, 3)
    assert check_snapshot(str(snap) + "/") == _complete(snap, TOTAL, 3)
    result, log = _observed(snap)
    assert result == _complete(f"observed://{snap}", TOTAL, 3)
    # one whole read of the index and the marker, one ranged read of each shard's head, and (the
    # snapshot holds integer tensors) one of config.json, for the dtype it declares (none here)
    assert log == [(INDEX, None, None), *((s, 0, _size(snap / s)) for s in (S1, S2, S3)), ("config.json", None, None),
                   (MARKER, None, None)]


def test_storage_options_reach_the_filesystem(snap: Path) -> None:
    result, _ = _observed(snap, vanish={S2: 0})
    assert result == _failed(f"observed://{snap}", P.MISSING_SHARD, f"{S2}: vanished while checking")


def test_marker_is_required_by_default_only(snap: Path) -> None:
    (snap / MARKER).unlink()
    assert check_snapshot(str(snap)) == _failed(snap, P.MISSING_MARKER, ".complete is missing")
    assert check_snapshot(str(snap), require_marker=True) == _failed(snap, P.MISSING_MARKER, ".complete is missing")
    assert check_snapshot(str(snap), require_marker=False) == _complete(snap, TOTAL, 3)


def test_an_existing_marker_is_checked_even_when_not_required(snap: Path) -> None:
    (snap / NOTES).write_text("changed")
    detail = f"{NOTES}: 7 bytes, .complete says 22"
    assert check_snapshot(str(snap), require_marker=False) == _failed(snap, P.STALE_MARKER, detail)


@pytest.mark.parametrize("make", [False, True])
def test_no_files_at_all(tmp_path: Path, make: bool) -> None:
    d = tmp_path / "nothing"
    if make:
        d.mkdir()
    expected = _failed(d, P.MISSING_MARKER, f"no snapshot files at {d}")
    assert check_snapshot(str(d)) == expected
    assert check_snapshot(str(d), require_marker=False) == expected


# ---- index ----------------------------------------------------------------------------------------

def test_missing_index(snap: Path) -> None:
    for s in (INDEX, S1, S2, S3):
        (snap / s).unlink()
    assert check_snapshot(str(snap)) == _failed(snap, P.MISSING_INDEX, f"{INDEX} is missing")


@pytest.mark.parametrize(("edit", "detail"), [
    (lambda i: i.pop("weight_map"), f"{INDEX}: Field required"),
    (lambda i: i.update(weight_map={}), f"{INDEX}: weight_map is empty"),
    (lambda i: i["weight_map"].update({"a": "sub/x.safetensors"}), f"{INDEX}: shard names outside the dir "
                                                                   "['sub/x.safetensors']"),
    (lambda i: i["weight_map"].update({"a": "sub\\x.safetensors"}), f"{INDEX}: shard names outside the dir "
                                                                    "['sub\\\\x.safetensors']"),
    (lambda i: i["weight_map"].update({"a": ".x.safetensors"}), f"{INDEX}: shard names outside the dir "
                                                                "['.x.safetensors']"),
    (lambda i: i["weight_map"].update({"a": "../d", "b": ".c", "c": "b/a", "d": "a\\b"}),
     f"{INDEX}: shard names outside the dir ['../d', '.c', 'a\\\\b']"),
])
def test_bad_index(snap: Path, edit, detail: str) -> None:
    _edit_index(snap, edit)
    assert check_snapshot(str(snap)) == _failed(snap, P.BAD_INDEX, detail)


@pytest.mark.parametrize(("gone", "detail"), [
    ([S2], f"{S2} is missing"),
    ([S3, S1], f"{S1} is missing (and 1 more)"),
    ([S3, S1, S2], f"{S1} is missing (and 2 more)"),
])
def test_absent_shards(snap: Path, gone: list[str], detail: str) -> None:
    for s in gone:
        (snap / s).unlink()
    assert check_snapshot(str(snap)) == _failed(snap, P.MISSING_SHARD, detail)


def test_header_names_differ_from_the_index(snap: Path) -> None:
    def rename(index: dict) -> None:
        wm = index["weight_map"]
        for i, name in enumerate(sorted(n for n, f in wm.items() if f == S3)):
            wm[f"ghost.{i}"] = wm.pop(name)

    _edit_index(snap, rename)
    detail = (f"{S3}: not in index ['empty', 'ids', 'layers.4.weight'], "
              "missing from header ['ghost.0', 'ghost.1', 'ghost.2']")
    assert check_snapshot(str(snap)) == _failed(snap, P.HEADER_MISMATCH, detail)


def test_total_size_must_equal_the_shards(snap: Path) -> None:
    _edit_index(snap, lambda i: i["metadata"].update(total_size=TOTAL + 2))
    detail = f"shards hold {TOTAL} tensor bytes, index says total_size {TOTAL + 2}"
    assert check_snapshot(str(snap)) == _failed(snap, P.TOTAL_SIZE_MISMATCH, detail)


# ---- shard sizes ----------------------------------------------------------------------------------

def test_shard_one_byte_short_or_long(snap: Path) -> None:
    p = snap / S2
    data, n = p.read_bytes(), _size(p)
    p.write_bytes(data[:-1])
    assert check_snapshot(str(snap)) == _failed(snap, P.TRUNCATED_SHARD, f"{S2}: size {n - 1} < {n} from its header")
    p.write_bytes(data + b"\0")
    assert check_snapshot(str(snap)) == _failed(snap, P.SHARD_SIZE_MISMATCH,
                                                f"{S2}: size {n + 1} > {n} from its header")


@pytest.mark.parametrize(("blob", "problem", "detail"), [
    (b"", P.TRUNCATED_SHARD, "0 bytes, shorter than a header"),
    (b"\0" * 7, P.TRUNCATED_SHARD, "7 bytes, shorter than a header"),
    (struct.pack("<Q", 0), P.BAD_HEADER, "header is not JSON (Expecting value: line 1 column 1 (char 0))"),
    (struct.pack("<Q", 1), P.TRUNCATED_SHARD, "header of 1 bytes, file 8 bytes"),
    (struct.pack("<Q", 9) + b"{}      ", P.TRUNCATED_SHARD, "header of 9 bytes, file 16 bytes"),
    (struct.pack("<Q", MAX_HEADER) + b"{}", P.TRUNCATED_SHARD, f"header of {MAX_HEADER} bytes, file 10 bytes"),
    (struct.pack("<Q", MAX_HEADER + 1) + b"{}", P.BAD_HEADER, f"header length {MAX_HEADER + 1} exceeds {MAX_HEADER}"),
    (struct.pack("<Q", 2**64 - 1) + b"{}", P.BAD_HEADER, f"header length {2**64 - 1} exceeds {MAX_HEADER}"),
])
def test_length_field_boundaries(tmp_path: Path, blob: bytes, problem: SnapshotProblem, detail: str) -> None:
    d = _single(tmp_path / "s", blob)
    assert check_snapshot(str(d), require_marker=False) == _failed(d, problem, f"{SINGLE_FILE}: {detail}")


def test_header_that_ends_the_file(tmp_path: Path) -> None:
    """8 + header == file size: no tensor bytes at all (an empty tensor) is complete."""
    d = _single(tmp_path / "s", _blob({"e": {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]}}))
    assert check_snapshot(str(d), require_marker=False) == _complete(d, 0, 1)


# ---- header content -------------------------------------------------------------------------------

@pytest.mark.parametrize(("header", "detail"), [
    (b"[1]", "header is not a JSON object"),
    (b"{", "header is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ({"__metadata__": 0}, "__metadata__ is not an object (a int)"),
    ({"__metadata__": "pt"}, "__metadata__ is not an object (a str)"),
    ({"__metadata__": {"format": "pt", "n": 1}, "w": _f32(1)}, "__metadata__ key 'n': value is a int, not a string"),
    ({"__metadata__": {"n": None}}, "__metadata__ key 'n': value is a NoneType, not a string"),
    ({"__metadata__": {"format": "tf"}, "w": _f32(1)}, "__metadata__ format 'tf' is not 'pt'"),
    ({"w": 5}, "entry 'w' is not an object"),
    ({"w": {**_f32(1), "dtype": "F99"}}, "tensor 'w': unknown dtype 'F99'"),
    ({"w": {"shape": [1], "data_offsets": [0, 4]}}, "tensor 'w': unknown dtype None"),
    ({"w": {"dtype": "F32", "data_offsets": [0, 4]}}, "tensor 'w': bad shape None"),
    ({"w": {**_f32(1), "shape": {}}}, "tensor 'w': bad shape {}"),
    ({"w": {**_f32(1), "shape": [True]}}, "tensor 'w': bad shape [True]"),
    ({"w": {**_f32(1), "shape": [1.0]}}, "tensor 'w': bad shape [1.0]"),
    ({"w": {**_f32(1), "shape": [-1]}}, "tensor 'w': bad shape [-1]"),
    ({"w": {**_f32(1), "shape": [2, -1]}}, "tensor 'w': bad shape [2, -1]"),
    ({"w": {"dtype": "F32", "shape": [1]}}, "tensor 'w': bad data_offsets None"),
    ({"w": {**_f32(1), "data_offsets": [0]}}, "tensor 'w': bad data_offsets [0]"),
    ({"w": {**_f32(1), "data_offsets": [0, 4, 4]}}, "tensor 'w': bad data_offsets [0, 4, 4]"),
    ({"w": {**_f32(1), "data_offsets": [0, 4.0]}}, "tensor 'w': bad data_offsets [0, 4.0]"),
    ({"w": {**_f32(1), "data_offsets": [False, 4]}}, "tensor 'w': bad data_offsets [False, 4]"),
    ({"w": {**_f32(2), "data_offsets": [0, 4]}}, "tensor 'w': data_offsets [0, 4] do not fit shape [2] of F32"),
    ({"w": {**_f32(1), "data_offsets": [4, 0]}}, "tensor 'w': data_offsets [4, 0] do not fit shape [1] of F32"),
    ({"a": _f32(1), "b": _f32(1, begin=8)}, "tensor 'b' starts at 8, expected 4 (gap or overlap)"),
    ({"a": _f32(2), "b": _f32(1, begin=4)}, "tensor 'b' starts at 4, expected 8 (gap or overlap)"),
    ({"a": _f32(1, begin=4)}, "tensor 'a' starts at 4, expected 0 (gap or overlap)"),
])
def test_bad_header(tmp_path: Path, header: dict | bytes, detail: str) -> None:
    d = _single(tmp_path / "s", _blob(header, b"\1" * 16))
    assert check_snapshot(str(d), require_marker=False) == _failed(d, P.BAD_HEADER, f"{SINGLE_FILE}: {detail}")


@pytest.mark.parametrize("meta", [{}, {"__metadata__": None}, {"__metadata__": {}}, {"__metadata__": {"k": "v"}},
                                  {"__metadata__": {"format": "pt"}}])
def test_metadata_that_is_absent_null_or_without_format_is_fine(tmp_path: Path, meta: dict) -> None:
    d = _single(tmp_path / "s", _blob({**meta, "a": _f32(1), "b": _f32(2, begin=4)}, b"\1" * 12))
    assert check_snapshot(str(d), require_marker=False) == _complete(d, 12, 1)


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_each_dtype_size(tmp_path: Path, dtype: str) -> None:
    size = DTYPE_SIZES[dtype]
    ok = _single(tmp_path / "ok", _blob({"w": {"dtype": dtype, "shape": [3], "data_offsets": [0, 3 * size]}},
                                        b"\1" * (3 * size)))
    assert check_snapshot(str(ok), require_marker=False) == _complete(ok, 3 * size, 1)
    bad = _single(tmp_path / "bad", _blob({"w": {"dtype": dtype, "shape": [3], "data_offsets": [0, 3 * size + 1]}},
                                          b"\1" * (3 * size + 1)))
    detail = f"{SINGLE_FILE}: tensor 'w': data_offsets [0, {3 * size + 1}] do not fit shape [3] of {dtype}"
    assert check_snapshot(str(bad), require_marker=False) == _failed(bad, P.BAD_HEADER, detail)


def test_scalar_and_zero_dim_tensors_are_fine(tmp_path: Path) -> None:
    header = {"s": {"dtype": "F16", "shape": [], "data_offsets": [0, 2]},
              "z": {"dtype": "F32", "shape": [3, 0], "data_offsets": [2, 2]}}
    d = _single(tmp_path / "s", _blob(header, b"\1\1"))
    assert check_snapshot(str(d), require_marker=False) == _complete(d, 2, 1)


# ---- the prefetch read ----------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "reads"), [
    (-1, [(SINGLE_FILE, 0, PREFETCH)]),
    (0, [(SINGLE_FILE, 0, PREFETCH)]),  # 8 + header == PREFETCH: one read
    (1, [(SINGLE_FILE, 0, PREFETCH), (SINGLE_FILE, PREFETCH, PREFETCH + 1)]),  # one byte more: the rest read
    (5000, [(SINGLE_FILE, 0, PREFETCH), (SINGLE_FILE, PREFETCH, PREFETCH + 5000)]),
])
def test_header_around_the_prefetch_size(tmp_path: Path, extra: int, reads: list) -> None:
    data = b"\1" * 4000
    d = _single(tmp_path / "s", _blob({"w": _f32(1000)}, data, length=PREFETCH - 8 + extra))
    assert check_snapshot(str(d), require_marker=False) == _complete(d, 4000, 1)
    result, _ = _observed(d)
    assert result == _failed(f"observed://{d}", P.MISSING_MARKER, ".complete is missing")
    log: list = []
    url = f"observed://{d}"
    assert check_snapshot(url, {"log": log}, require_marker=False) == _complete(url, 4000, 1)
    assert log == reads


def test_a_small_header_in_a_large_shard_reads_one_prefetch(tmp_path: Path) -> None:
    d = _single(tmp_path / "s", _blob({"w": _f32(50_000)}, b"\1" * 200_000))
    log: list = []
    assert check_snapshot(f"observed://{d}", {"log": log}, require_marker=False) == _complete(f"observed://{d}",
                                                                                             200_000, 1)
    assert log == [(SINGLE_FILE, 0, PREFETCH)]


def test_a_shard_that_vanishes_before_the_rest_of_its_header_is_read(tmp_path: Path) -> None:
    d = _single(tmp_path / "s", _blob({"w": _f32(1)}, b"\1" * 4, length=PREFETCH))
    result = check_snapshot(f"observed://{d}", {"vanish": {SINGLE_FILE: 1}}, require_marker=False)
    assert result == _failed(f"observed://{d}", P.MISSING_SHARD, f"{SINGLE_FILE}: vanished while checking")


# ---- single file and adapter snapshots ------------------------------------------------------------

def _safetensors_file(d: Path, name: str, export_id: str | None) -> int:
    d.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"} | ({EXPORT_ID_KEY: export_id} if export_id else {})
    save_file({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)}, str(d / name), metadata=meta)
    return _size(d / name)


def test_single_file_with_a_manifest(tmp_path: Path) -> None:
    d = tmp_path / "s"
    size = _safetensors_file(d, SINGLE_FILE, "e1")
    (d / MARKER).write_bytes(_manifest("e1", {SINGLE_FILE: size}, 28))
    assert check_snapshot(str(d)) == _complete(d, 28, 1)
    (d / MARKER).write_bytes(_manifest("e2", {SINGLE_FILE: size}, 28))
    assert check_snapshot(str(d)) == _failed(d, P.STALE_MARKER, f"{SINGLE_FILE} is from export e1, .complete e2")


def test_adapter_snapshots(tmp_path: Path) -> None:
    d = tmp_path / "a"
    size = _safetensors_file(d, ADAPTER_WEIGHTS, "e1")
    (d / ADAPTER_CONFIG).write_text('{"r": 8}')
    (d / MARKER).write_bytes(_manifest("e1", {ADAPTER_WEIGHTS: size, ADAPTER_CONFIG: 8}, 28))
    assert check_snapshot(str(d)) == _complete(d, 28, 1)
    assert check_snapshot(str(d), adapter=True) == _complete(d, 28, 1)
    assert check_snapshot(str(d), adapter=False) == _failed(d, P.MISSING_INDEX, f"{INDEX} is missing")
    (d / ADAPTER_WEIGHTS).unlink()
    assert check_snapshot(str(d)) == _failed(d, P.MISSING_SHARD, f"{ADAPTER_WEIGHTS} is missing")


def test_adapter_flag_on_a_full_model(snap: Path) -> None:
    assert check_snapshot(str(snap), adapter=True) == _failed(snap, P.MISSING_FILE, f"{ADAPTER_CONFIG} is missing")
    assert check_snapshot(str(snap), adapter=False) == _complete(snap, TOTAL, 3)


def test_sharded_adapter(snap: Path) -> None:
    (snap / INDEX).rename(snap / ADAPTER_INDEX)
    (snap / ADAPTER_CONFIG).write_text("{}")
    (snap / MARKER).unlink()
    assert check_snapshot(str(snap), require_marker=False) == _complete(snap, TOTAL, 3)
    (snap / MARKER).write_bytes(b"")
    assert check_snapshot(str(snap)) == _complete(snap, TOTAL, 3)
    _set_mtimes(snap, dict.fromkeys([S1, S2, S3, MARKER], T) | {ADAPTER_INDEX: T + SEC})
    stale = _failed(snap, P.STALE_MARKER, f"bare .complete is older than ['{ADAPTER_INDEX}']")
    assert check_snapshot(str(snap)) == stale


# ---- bare markers ---------------------------------------------------------------------------------

T = 1_700_000_000 * 10**9  # a fixed mtime (ns)
SEC = 10**9  # listings give mtimes as float seconds: a nanosecond apart reads as equal


@pytest.mark.parametrize("content", [b"", b" \n"])
def test_bare_marker_as_new_as_the_files_is_fine(snap: Path, content: bytes) -> None:
    (snap / MARKER).write_bytes(content)
    _set_mtimes(snap, dict.fromkeys([S1, S2, S3, INDEX, MARKER], T))  # equal times: not older
    assert check_snapshot(str(snap)) == _complete(snap, TOTAL, 3)


def test_bare_marker_older_than_files(snap: Path) -> None:
    (snap / MARKER).write_bytes(b"")
    _set_mtimes(snap, dict.fromkeys([S1, S2, S3, INDEX], T + SEC) | {MARKER: T, "config.json": T + 5 * SEC})
    detail = f"bare .complete is older than ['{S1}', '{S2}', '{S3}']"  # 4 newer files, 3 named
    assert check_snapshot(str(snap)) == _failed(snap, P.STALE_MARKER, detail)
    _set_mtimes(snap, dict.fromkeys([S1, S2, S3], T - SEC))
    detail = f"bare .complete is older than ['{INDEX}']"
    assert check_snapshot(str(snap)) == _failed(snap, P.STALE_MARKER, detail)


def test_bare_marker_on_a_single_file(tmp_path: Path) -> None:
    d = tmp_path / "s"
    _safetensors_file(d, SINGLE_FILE, None)
    (d / MARKER).write_bytes(b"")
    _set_mtimes(d, {SINGLE_FILE: T, MARKER: T})
    assert check_snapshot(str(d)) == _complete(d, 28, 1)
    _set_mtimes(d, {SINGLE_FILE: T + SEC})
    assert check_snapshot(str(d)) == _failed(d, P.STALE_MARKER, f"bare .complete is older than ['{SINGLE_FILE}']")


# ---- manifest markers -----------------------------------------------------------------------------

@pytest.mark.parametrize(("content", "msg"), [
    (b"{not json", "Invalid JSON: key must be a string at line 1 column 2"),
    (b'{"export_id": 5}', "Input should be a valid string"),
])
def test_marker_that_is_not_a_manifest(snap: Path, content: bytes, msg: str) -> None:
    (snap / MARKER).write_bytes(content)
    assert check_snapshot(str(snap)) == _failed(snap, P.BAD_MARKER, f".complete is not a manifest: {msg}")


def test_index_of_another_export(snap: Path) -> None:
    marked = _export_id(snap)
    _edit_index(snap, lambda i: i["metadata"].update({EXPORT_ID_KEY: "f" * 32}))
    detail = f".complete is for export {marked}, index {'f' * 32}"
    assert check_snapshot(str(snap)) == _failed(snap, P.STALE_MARKER, detail)


def test_shards_of_another_export(snap: Path) -> None:
    old_index, old_marker = (snap / INDEX).read_bytes(), (snap / MARKER).read_bytes()
    marked = _export_id(snap)
    write_snapshot(named_tensors(seed=1), str(snap), max_shard_bytes=30_000)  # same layout and sizes
    newer = _export_id(snap)
    (snap / INDEX).write_bytes(old_index)
    (snap / MARKER).write_bytes(old_marker)
    detail = f"{S1} is from export {newer}, .complete {marked}"
    assert check_snapshot(str(snap)) == _failed(snap, P.STALE_MARKER, detail)


def test_index_changed_after_the_marker(snap: Path) -> None:
    index = json.loads((snap / INDEX).read_text())
    (snap / INDEX).write_text(json.dumps(index, indent=1))  # the same content, other bytes
    detail = f"{INDEX} changed after .complete was written"
    assert check_snapshot(str(snap)) == _failed(snap, P.STALE_MARKER, detail)


def test_listed_files_missing_or_resized(snap: Path) -> None:
    (snap / "config.json").write_text('{"model_type": "llama", "x": 1}')
    detail = "config.json: 31 bytes, .complete says 23"
    assert check_snapshot(str(snap)) == _failed(snap, P.STALE_MARKER, detail)
    (snap / "config.json").unlink()
    assert check_snapshot(str(snap)) == _failed(snap, P.MISSING_FILE, "config.json listed in .complete is missing")
