"""write_snapshot on a local directory: plan, shards, index, base files, marker last, cleanup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pinned_eval.snapshot.check import check_snapshot
from pinned_eval.snapshot.layout import INDEX, MARKER, Manifest
from pinned_eval.snapshot.writer import SnapshotWriteError, TensorSpec, plan_shards, write_snapshot
from tests.snapshot_fixtures import named_tensors, tiny_hf_base


def _read_all(d: Path) -> dict[str, torch.Tensor]:
    index = json.loads((d / INDEX).read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(d / fname), "pt") as f:
            for k in f.keys():  # noqa: SIM118
                out[k] = f.get_tensor(k)
    return out


def test_round_trip_sharded_any_order(tmp_path: Path) -> None:
    ts = named_tensors()
    plan = [TensorSpec.of(n, t) for n, t in ts]
    res = write_snapshot(reversed(ts), str(tmp_path / "s"), plan=plan, max_shard_bytes=30_000)
    d = tmp_path / "s"
    assert res.shards == 3 and res.path == str(d)
    names = sorted(p.name for p in d.iterdir())
    assert names == [MARKER, *[f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)], INDEX]
    got = _read_all(d)
    assert set(got) == {n for n, _ in ts}
    for n, t in ts:
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    index = json.loads((d / INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in plan)
    assert res.bytes == sum(p.stat().st_size for p in d.iterdir())
    assert check_snapshot(str(d)).complete


def test_plan_is_greedy_and_oversize_tensor_gets_own_shard() -> None:
    specs = [TensorSpec("a", (10,), torch.float32), TensorSpec("big", (100,), torch.float32),
             TensorSpec("b", (5,), torch.float32), TensorSpec("c", (5,), torch.float32)]
    m = plan_shards(specs, max_shard_bytes=60)
    assert m == {"a": "model-00001-of-00003.safetensors", "big": "model-00002-of-00003.safetensors",
                 "b": "model-00003-of-00003.safetensors", "c": "model-00003-of-00003.safetensors"}


def test_without_plan_uses_tensors_in_order(tmp_path: Path) -> None:
    ts = named_tensors(n=2)
    res = write_snapshot(iter(ts), str(tmp_path / "s"))
    assert res.shards == 1
    assert set(_read_all(tmp_path / "s")) == {n for n, _ in ts}


@pytest.mark.parametrize(("case", "message"), [
    ("duplicate", "arrived twice"), ("unplanned", "not in the plan"),
    ("missing", "never arrived"), ("shape", "shape"),
])
def test_plan_violations_raise_and_leave_nothing(tmp_path: Path, case: str, message: str) -> None:
    ts = named_tensors(n=4)
    plan = [TensorSpec.of(n, t) for n, t in ts]
    stream = list(ts)
    if case == "duplicate":
        stream.append(ts[0])
    elif case == "unplanned":
        stream.insert(1, ("intruder", torch.zeros(2)))
    elif case == "missing":
        stream.pop(2)
    else:
        stream[1] = (ts[1][0], torch.zeros(3, 3))
    dest = tmp_path / "s"
    with pytest.raises(SnapshotWriteError, match=message):
        write_snapshot(stream, str(dest), plan=plan, max_shard_bytes=13_000)
    assert not dest.exists()


def test_failure_midway_removes_only_what_it_wrote(tmp_path: Path) -> None:
    dest = tmp_path / "s"
    dest.mkdir()
    (dest / "notes.txt").write_text("user file")
    ts = named_tensors(n=6)

    def stream():
        yield from ts[:4]
        raise RuntimeError("trainer died")

    with pytest.raises(RuntimeError, match="trainer died"):
        write_snapshot(stream(), str(dest), plan=[TensorSpec.of(n, t) for n, t in ts], max_shard_bytes=13_000)
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]


def test_stale_marker_and_weights_of_an_earlier_export_are_cleared(tmp_path: Path) -> None:
    dest = tmp_path / "s"
    write_snapshot(named_tensors(n=6), str(dest), max_shard_bytes=13_000)
    assert len(list(dest.glob("*.safetensors"))) > 2

    def failing():
        yield named_tensors(n=1)[0]
        assert not (dest / MARKER).exists(), "the old marker must go before any new byte"
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        write_snapshot(failing(), str(dest), plan=[TensorSpec.of(n, t) for n, t in named_tensors(n=1)])
    assert not (dest / MARKER).exists() and not list(dest.glob("*.safetensors"))
    res = write_snapshot(named_tensors(n=1), str(dest))
    assert res.shards == 1 and sorted(p.name for p in dest.glob("*.safetensors")) == [
        "model-00001-of-00001.safetensors"]
    assert check_snapshot(str(dest)).complete


def test_base_files_copied_but_never_weights(tmp_path: Path) -> None:
    base = tiny_hf_base(tmp_path / "base")
    (base / "stray.bin").write_bytes(b"x")
    ts = [(n, t.to(torch.bfloat16)) for n, t in named_tensors(n=2) if t.is_floating_point()]
    write_snapshot(ts, str(tmp_path / "s"), base_hf_dir=str(base), metadata={"step": 7})
    out = {p.name for p in (tmp_path / "s").iterdir()}
    expected_meta = {p.name for p in base.iterdir()
                     if not p.name.endswith((".safetensors", ".bin")) and not p.name.endswith(".index.json")}
    assert "config.json" in expected_meta
    assert out == expected_meta | {MARKER, INDEX, "model-00001-of-00001.safetensors"}
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    manifest = Manifest.model_validate_json((tmp_path / "s" / MARKER).read_text())
    assert manifest.metadata == {"step": 7} and "config.json" in manifest.files


def test_planned_dtype_casts(tmp_path: Path) -> None:
    t = torch.randn(8, 8)
    write_snapshot([("w", t)], str(tmp_path / "s"), plan=[TensorSpec("w", (8, 8), torch.bfloat16)])
    got = _read_all(tmp_path / "s")["w"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, t.to(torch.bfloat16))


def test_bad_inputs_fail_before_writing(tmp_path: Path) -> None:
    with pytest.raises(SnapshotWriteError, match="empty"):
        write_snapshot([], str(tmp_path / "a"))
    with pytest.raises(SnapshotWriteError, match="twice in the plan"):
        write_snapshot([], str(tmp_path / "b"), plan=[TensorSpec("w", (1,), torch.float32)] * 2)
    with pytest.raises(TypeError):
        write_snapshot(named_tensors(n=1), str(tmp_path / "c"), metadata={"bad": object()})
    assert not any(tmp_path.iterdir())


def test_shard_written_once_when_its_last_tensor_arrives(tmp_path: Path) -> None:
    ts = named_tensors(n=6)[:6]  # six 12 KiB fp32 tensors -> three shards of two
    plan = [TensorSpec.of(n, t) for n, t in ts]
    dest = tmp_path / "s"
    first = dest / "model-00001-of-00003.safetensors"
    seen: dict[str, tuple[int, int]] = {}

    def stream():
        yield ts[0]
        yield ts[2]  # out of order: shard 2 opens before shard 1 is complete
        assert not first.exists(), "shard 1 written before all its tensors arrived"
        yield ts[1]
        st = first.stat()  # shard 1 is complete now, and on disk
        seen["first"] = (st.st_ino, st.st_mtime_ns)
        yield from ts[3:]

    write_snapshot(stream(), str(dest), plan=plan, max_shard_bytes=2 * 64 * 48 * 4)
    st = first.stat()
    assert (st.st_ino, st.st_mtime_ns) == seen["first"], "shard 1 was rewritten"
    assert check_snapshot(str(dest)).complete


def test_every_file_and_the_dir_are_fsynced_before_the_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    import pinned_eval.snapshot.writer as writer

    d = tmp_path / "s"
    synced: list[tuple[str, bool]] = []  # (name, marker present when its fsync finished)

    def slow_fsync(path: str) -> None:  # background fsyncs that finish late
        time.sleep(0.05)
        synced.append((Path(path).name, (d / MARKER).exists()))

    monkeypatch.setattr(writer, "fsync_path", slow_fsync)
    write_snapshot(named_tensors(), str(d), base_hf_dir=str(tiny_hf_base(tmp_path)), max_shard_bytes=30_000)
    on_disk = {p.name for p in d.iterdir()} - {MARKER}
    assert {name for name, _ in synced} == on_disk | {"s"}, "every file but the marker, and the dir"
    assert synced[-1][0] == "s", "the directory last"
    assert not any(marker for _, marker in synced), "no fsync finished after the marker appeared"


def test_a_failed_fsync_fails_the_export_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pinned_eval.snapshot.writer as writer

    def failing_fsync(path: str) -> None:
        if Path(path).name.startswith("model-00002"):
            raise OSError(5, "Input/output error", path)

    monkeypatch.setattr(writer, "fsync_path", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        write_snapshot(named_tensors(), str(tmp_path / "s"), max_shard_bytes=30_000)
    assert not (tmp_path / "s").exists()
