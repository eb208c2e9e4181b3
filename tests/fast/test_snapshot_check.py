"""check_snapshot on local snapshots: each typed problem, and random corruptions (hypothesis)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from pinned_eval.snapshot.check import SnapshotProblem, check_snapshot
from pinned_eval.snapshot.layout import INDEX, MARKER
from pinned_eval.snapshot.writer import write_snapshot
from tests.snapshot_fixtures import named_tensors

P = SnapshotProblem
SHARD2 = "model-00002-of-00003.safetensors"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tpl") / "snap"
    write_snapshot(named_tensors(), str(d), max_shard_bytes=30_000, metadata={"step": 1})
    (d / "config.json").write_text('{"model_type": "llama"}')  # a non-weight file the marker lists
    (d / MARKER).unlink()
    write_snapshot(named_tensors(), str(d), max_shard_bytes=30_000, base_hf_dir=str(d))  # lists config.json
    assert check_snapshot(str(d)).complete
    return d


@pytest.fixture
def snap(template: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "snap"))


def _problem(d: Path) -> SnapshotProblem | None:
    r = check_snapshot(str(d))
    assert r.complete == (r.problem is None)
    return r.problem


def test_complete_reports_sizes(snap: Path) -> None:
    r = check_snapshot(str(snap))
    assert r.complete and r.shards == 3
    assert r.total_size == json.loads((snap / INDEX).read_text())["metadata"]["total_size"]


def test_shard_truncated_by_one_byte(snap: Path) -> None:
    p = snap / SHARD2
    p.write_bytes(p.read_bytes()[:-1])
    assert _problem(snap) is P.TRUNCATED_SHARD
    assert "size" in check_snapshot(str(snap)).detail


def test_shard_with_appended_byte(snap: Path) -> None:
    with open(snap / SHARD2, "ab") as f:
        f.write(b"\0")
    assert _problem(snap) is P.SHARD_SIZE_MISMATCH


def test_missing_shard_marker_index_file(snap: Path, tmp_path: Path) -> None:
    for name, problem in [(SHARD2, P.MISSING_SHARD), ("config.json", P.MISSING_FILE),
                          (INDEX, P.MISSING_INDEX), (MARKER, P.MISSING_MARKER)]:
        d = Path(shutil.copytree(snap, tmp_path / name))
        (d / name).unlink()
        assert _problem(d) is problem, name
    assert _problem(tmp_path / "nothing-here") is P.MISSING_MARKER


def test_stale_marker_from_an_earlier_export(snap: Path) -> None:
    old_marker = (snap / MARKER).read_bytes()
    # same names, shapes, shard layout and sizes: only the export id tells the exports apart
    write_snapshot(named_tensors(seed=1), str(snap), max_shard_bytes=30_000, base_hf_dir=str(snap))
    assert check_snapshot(str(snap)).complete
    (snap / MARKER).write_bytes(old_marker)
    r = check_snapshot(str(snap))
    assert r.problem is P.STALE_MARKER and "export" in r.detail


def test_bare_marker_judged_by_mtime(snap: Path) -> None:
    (snap / MARKER).write_bytes(b"")
    assert _problem(snap) is None
    shard = snap / SHARD2
    st_ = shard.stat()
    os.utime(snap / MARKER, ns=(st_.st_atime_ns, st_.st_mtime_ns - 10**9))
    assert _problem(snap) is P.STALE_MARKER


def test_marker_that_is_not_a_manifest(snap: Path) -> None:
    (snap / MARKER).write_text("{not json")
    assert _problem(snap) is P.BAD_MARKER


def _edit_index(d: Path, fn) -> None:
    index = json.loads((d / INDEX).read_text())
    fn(index)
    (d / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda i: i["weight_map"].pop(next(iter(i["weight_map"]))), P.HEADER_MISMATCH),
    (lambda i: i["weight_map"].update({"ghost": SHARD2}), P.HEADER_MISMATCH),
    (lambda i: i["weight_map"].update({"ghost": "model-00009-of-00009.safetensors"}), P.MISSING_SHARD),
    (lambda i: i["weight_map"].update({"x": "../../etc/passwd"}), P.BAD_INDEX),
    (lambda i: i["metadata"].update(total_size=i["metadata"]["total_size"] + 2), P.TOTAL_SIZE_MISMATCH),
    (lambda i: i.pop("weight_map"), P.BAD_INDEX),
    (lambda i: i["metadata"].update(note="hand edited"), P.STALE_MARKER),  # valid, but not what was marked
])
def test_hand_edited_index(snap: Path, edit, problem: SnapshotProblem) -> None:
    _edit_index(snap, edit)
    assert _problem(snap) is problem


def test_unparseable_index(snap: Path) -> None:
    (snap / INDEX).write_text('{"metadata": ')
    assert _problem(snap) is P.BAD_INDEX


def test_header_names_swapped_between_shards(snap: Path) -> None:
    index = json.loads((snap / INDEX).read_text())
    a, b = sorted(index["weight_map"])[:2]
    wm = index["weight_map"]
    if wm[a] == wm[b]:
        b = next(n for n in sorted(wm) if wm[n] != wm[a])
    wm[a], wm[b] = wm[b], wm[a]
    (snap / INDEX).write_text(json.dumps(index))
    assert _problem(snap) is P.HEADER_MISMATCH


def test_marker_not_required_still_checks_structure(snap: Path) -> None:
    (snap / MARKER).unlink()
    assert _problem(snap) is P.MISSING_MARKER
    assert check_snapshot(str(snap), require_marker=False).complete
    shard = snap / SHARD2
    shard.write_bytes(shard.read_bytes()[:-1])
    assert check_snapshot(str(snap), require_marker=False).problem is P.TRUNCATED_SHARD


def test_single_file_snapshot_without_index(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    save_file({"w": torch.ones(3)}, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert check_snapshot(str(d), require_marker=False).complete  # as save_pretrained leaves it
    (d / MARKER).touch()
    assert _problem(d) is None
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-1])
    assert _problem(d) is P.TRUNCATED_SHARD


# ---- random corruptions: never a crash, never a false "complete" ----------------------------------

def _loads_like_template(d: Path, template: Path) -> bool:
    """The ground truth behind 'complete': the index is the same and every tensor reads back equal."""
    if json.loads((d / INDEX).read_text()) != json.loads((template / INDEX).read_text()):
        return False
    wm = json.loads((d / INDEX).read_text())["weight_map"]
    expected = dict(named_tensors())
    for name, fname in wm.items():
        with safe_open(str(d / fname), "pt") as f:
            if not torch.equal(f.get_tensor(name), expected[name]):
                return False
    return True


def _header_len(p: Path) -> int:
    return 8 + struct.unpack("<Q", p.read_bytes()[:8])[0]


corruption = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 3), st.integers(1, 10**6)),
    st.tuples(st.just("append"), st.integers(0, 3), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("flip"), st.integers(0, 3), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("delete"), st.integers(0, 10)),
    st.tuples(st.just("index"), st.sampled_from(["drop", "rename", "total", "shard", "junk", "reformat"]),
              st.integers(0, 10**6)),
)


def _apply(d: Path, c: tuple) -> None:
    """Apply one corruption (a no-op when its target is already gone)."""
    shards = sorted(d.glob("model-*.safetensors"))
    kind = c[0]
    if kind in ("truncate", "append", "flip"):
        if not shards:
            return
        p = shards[c[1] % len(shards)]
        data = bytearray(p.read_bytes())
        if kind == "truncate" and data:
            data = data[: c[2] % len(data)]
        elif kind == "append":
            data += c[2]
        elif kind == "flip" and len(data) >= 8:
            pos = c[2] % min(len(data), _header_len(p))  # only the length field and the JSON header
            data[pos] ^= c[3]
        p.write_bytes(bytes(data))
        return
    if kind == "delete":
        files = sorted(d.iterdir())
        if files:
            files[c[1] % len(files)].unlink()
        return
    if not (d / INDEX).exists():
        return
    raw = (d / INDEX).read_bytes()
    if c[1] == "junk":
        (d / INDEX).write_bytes(raw[: c[2] % 200])
        return
    try:
        index = json.loads(raw)
        wm, names = index["weight_map"], sorted(index["weight_map"])
        pick = names[c[2] % len(names)]
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        return  # already junk
    if c[1] == "drop":
        wm.pop(pick)
    elif c[1] == "rename":
        wm[pick + "_x"] = wm.pop(pick)
    elif c[1] == "total":
        index["metadata"]["total_size"] += 1 + c[2] % 1000
    elif c[1] == "shard":
        others = sorted(set(wm.values()) - {wm[pick]})
        if others:
            wm[pick] = others[c[2] % len(others)]
    (d / INDEX).write_text(json.dumps(index, indent=c[2] % 3))


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corruptions=st.lists(corruption, min_size=1, max_size=3))
def test_random_corruptions_never_crash_or_pass_falsely(template: Path, corruptions: list[tuple]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(shutil.copytree(template, Path(tmp) / "snap"))
        for c in corruptions:
            _apply(d, c)
        r = check_snapshot(str(d))
        assert isinstance(r.problem, SnapshotProblem) or r.problem is None
        now, before = _files(d), _files(template)
        if now == before:
            assert r.complete, f"untouched snapshot reported {r.problem}: {r.detail}"
        if r.complete:
            # complete => the same files, the same sizes, the same index bytes, every tensor equal
            assert {k: len(v) for k, v in now.items()} == {k: len(v) for k, v in before.items()}, corruptions
            assert now[INDEX] == before[INDEX], corruptions
            assert _loads_like_template(d, template), f"false complete after {corruptions}"


def test_header_longer_than_one_prefetch(tmp_path: Path) -> None:
    from pinned_eval.snapshot.check import PREFETCH

    ts = [(f"model.layers.{i}.some_long_parameter_name.weight", torch.full((2,), float(i))) for i in range(2500)]
    write_snapshot(ts, str(tmp_path / "s"))
    shard = tmp_path / "s" / "model-00001-of-00001.safetensors"
    assert struct.unpack("<Q", shard.read_bytes()[:8])[0] > PREFETCH
    assert _problem(tmp_path / "s") is None
    shard.write_bytes(shard.read_bytes()[:-1])
    assert _problem(tmp_path / "s") is P.TRUNCATED_SHARD
