"""Staging (pinned_eval/snapshot/staging.py) on a local root and on S3 (moto's server on 127.0.0.1):
exact refusals of `_confine` and the constructor, `path_for`'s 8-digit layout, every field `list`
reports, `put` marker-last over an existing or identical destination, the keep-ring and keep_best
boundaries of `retire`, and `materialize`'s named, reused, LRU-bounded cache with its cleanup of
abandoned downloads (`make mutants` killers, docs/testing.md)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from pinned_eval.points import check_run_name
from pinned_eval.settings import get_settings
from pinned_eval.snapshot import confined
from pinned_eval.snapshot.check import check_snapshot
from pinned_eval.snapshot.layout import MARKER, RETIRED, resolve
from pinned_eval.snapshot.staging import (
    RetireResult,
    SnapshotIncompleteError,
    StagedSnapshot,
    Staging,
    StagingPathError,
    UnsafeStagingRootError,
    _pid_alive,
)
from pinned_eval.snapshot.writer import write_snapshot
from tests.s3_fixtures import S3Server, s3_server  # noqa: F401 - fixture
from tests.snapshot_fixtures import named_tensors

T0 = 1_700_000_000.5  # a fixed modification time (epoch seconds)


# ---- helpers ---------------------------------------------------------------------------------


def _local(tmp_path: Path, **kw: Any) -> Staging:
    return Staging(str(tmp_path / "stage"), cache_dir=tmp_path / "cache", **kw)


def _s3(server: S3Server, tmp_path: Path, **kw: Any) -> Staging:
    return Staging(f"s3://{server.make_bucket()}/stage", storage_options=server.storage_options,
                   cache_dir=tmp_path / "cache", **kw)


def _stage(staging: Staging, step: int, run: str = "exp1", seed: int | None = None) -> str:
    """A complete snapshot written by the project's writer at `path_for(run, step)`."""
    url = staging.path_for(run, step)
    write_snapshot(named_tensors(seed=step if seed is None else seed), url, storage_options=staging.storage_options,
                   metadata={"run": run, "step": step})
    return url


def _files(d: str | Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(d).iterdir() if p.is_file()}


def _remote_files(staging: Staging, url: str) -> dict[str, bytes]:
    fs, p = resolve(url, staging.storage_options)
    return {e.rsplit("/", 1)[-1]: fs.cat_file(e) for e in fs.ls(p, detail=False)}


def _set_mtimes(d: Path, newest: float) -> None:
    """Every file of `d` one minute older than `newest`, the marker (if any) exactly `newest`."""
    files = sorted(p for p in d.iterdir() if p.is_file())
    for p in files:
        os.utime(p, (newest - 60, newest - 60))
    last = d / MARKER if (d / MARKER).exists() else files[-1]
    os.utime(last, (newest, newest))


def _entry(staging: Staging, url: str) -> Path:
    run, step_dir = url.split("://", 1)[1].split("/")[-2:]
    return staging.cache_dir / f"{run}-{step_dir}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def _inodes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in [d, *d.iterdir()]}


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()  # reaped: the pid names no process now
    return child.pid


@pytest.fixture
def live_child() -> Iterator[subprocess.Popen[bytes]]:
    """A child blocked on stdin: alive until its stdin closes, then it exits 0 (unless signalled).

    SIGHUP is set back to its default (a parent under nohup ignores it) before the child says ready."""
    code = "import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); print(flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"\n"
    yield child
    if child.poll() is None:
        child.kill()
        child.wait()


@pytest.fixture
def s3(s3_server: S3Server) -> S3Server:  # noqa: F811 - the session's moto server, started once
    return s3_server


def _raises(exc: type[BaseException], message: str) -> Any:
    return pytest.raises(exc, match=f"^{re.escape(message)}$")


# ---- construction and paths ------------------------------------------------------------------


def test_constructor_defaults_and_copies(tmp_path: Path, s3: S3Server) -> None:
    local = Staging(str(tmp_path / "stage"))
    assert (local.keep_snapshots, local.keep_best, local.cache_max_bytes, local.storage_options) == (2, 0, None, {})
    assert local.cache_dir == get_settings().home / "snapshot-cache"
    assert local.local is True
    assert (local.root, local.root_path) == (str(tmp_path / "stage"), str(tmp_path / "stage"))
    given = Staging(str(tmp_path / "stage"), cache_dir=tmp_path / "c", keep_snapshots=0, keep_best=0,
                    cache_max_bytes=0)
    assert (given.cache_dir, given.keep_snapshots, given.keep_best, given.cache_max_bytes) == (tmp_path / "c", 0, 0, 0)
    opts = s3.storage_options
    remote = Staging("s3://bkt/deep/stage/", storage_options=opts, keep_snapshots=5, keep_best=3, cache_max_bytes=7)
    assert remote.storage_options == opts and remote.storage_options is not opts
    assert (remote.root, remote.root_path, remote.local) == ("s3://bkt/deep/stage", "bkt/deep/stage", False)
    assert (remote.keep_snapshots, remote.keep_best, remote.cache_max_bytes) == (5, 3, 7)
    assert remote.fs.endpoint_url == s3.endpoint_url


def test_a_root_under_a_symlinked_parent_is_resolved(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    staging = Staging(str(tmp_path / "link" / "stage"), cache_dir=tmp_path / "cache")
    assert (staging.root, staging.root_path) == (str(tmp_path / "real" / "stage"),) * 2


def test_a_symlinked_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "stage").symlink_to(tmp_path / "real", target_is_directory=True)
    root = str(tmp_path / "stage")
    target = str(tmp_path / "real")
    with _raises(UnsafeStagingRootError, f"staging root {root!r} refused: it is a symlink (to {target!r})"):
        Staging(root, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize(("kw", "message"), [
    ({"keep_snapshots": -1}, "keep_snapshots must be >= 0, got -1"),
    ({"keep_best": -1}, "keep_best must be >= 0, got -1"),
    ({"cache_max_bytes": -1}, "cache_max_bytes must be >= 0, got -1"),
])
def test_negative_settings_are_refused(tmp_path: Path, kw: dict[str, int], message: str) -> None:
    with _raises(ValueError, message):
        Staging(str(tmp_path / "stage"), cache_dir=tmp_path / "cache", **kw)


@pytest.mark.parametrize("root", ["s3://", "s3:///"])
def test_an_s3_root_without_a_bucket_is_refused(root: str) -> None:
    with _raises(StagingPathError, f"staging root {root!r} names no bucket"):
        Staging(root)


def test_path_for_is_run_key_and_eight_digit_step(tmp_path: Path, s3: S3Server) -> None:
    staging = _local(tmp_path)
    root = str(tmp_path / "stage")
    assert staging.path_for("exp-1_a", 12) == f"{root}/exp-1_a/step_00000012"
    assert staging.path_for("Exp.1", 0) == f"{root}/e.xp_.1/step_00000000"
    assert staging.path_for("exp1", 123456789) == f"{root}/exp1/step_123456789"
    remote = Staging("s3://bkt/stage", storage_options=s3.storage_options)
    assert remote.path_for("exp1", 3) == "s3://bkt/stage/exp1/step_00000003"
    with _raises(StagingPathError, "step must be >= 0, got -1"):
        staging.path_for("exp1", -1)
    with pytest.raises(ValueError) as rule:
        check_run_name("a b")
    with _raises(StagingPathError, str(rule.value)):
        staging.path_for("a b", 1)


# ---- confinement -----------------------------------------------------------------------------


def test_local_refusals_name_their_reason(tmp_path: Path) -> None:
    staging = _local(tmp_path)
    root = staging.root
    evil = f"{root}-evil/exp1/step_00000001"  # a sibling sharing the root's name as a prefix
    cases = [
        (f"{root}/exp1/../../x", "contains a '..' segment"),
        (f"{root}\\exp1\\..\\x", "contains a '..' segment"),
        ("s3://bkt/stage/exp1", f"is not on the local staging root {root}"),
        ("stage/exp1/step_00000001", f"is not an absolute path under {root}"),
        (root, f"resolves to {root!r}, outside staging root {root}"),
        (evil, f"resolves to {evil!r}, outside staging root {root}"),
    ]
    for path, reason in cases:
        with _raises(StagingPathError, f"{path!r} {reason}"):
            staging.delete(path)


@pytest.mark.parametrize("slash", ["", "/"])
def test_a_symlinked_snapshot_dir_is_refused_even_with_a_trailing_slash(tmp_path: Path, slash: str) -> None:
    staging = _local(tmp_path)
    target = Path(_stage(staging, 1))
    link = Path(staging.path_for("exp1", 2))
    link.symlink_to(target, target_is_directory=True)
    with _raises(StagingPathError, f"{str(link) + slash!r} is a symlink; staging deletes only real directories"):
        staging.delete(str(link) + slash)
    assert check_snapshot(str(target)).complete


def test_local_confine_returns_the_real_path(tmp_path: Path) -> None:
    staging = _local(tmp_path)
    url = _stage(staging, 1)
    assert staging._confine(f"file://{url}") == url
    assert staging._confine(f"{staging.root}//exp1/./step_00000001/") == url


def test_s3_refusals_need_no_server() -> None:
    staging = Staging("s3://bkt/deep/stage", storage_options={"endpoint_url": "http://127.0.0.1:9"})
    root = staging.root
    cases = [
        ("/local/path", f"is not an s3:// URL under staging root {root}"),
        ("s3://other/deep/stage/exp1/step_00000001", f"is in another bucket than staging root {root}"),
        ("s3://bkt-evil/deep/stage/exp1", f"is in another bucket than staging root {root}"),
        ("s3://bkt/deep/stage-evil/exp1", f"is outside staging root {root}"),
        ("s3://bkt/deep/stage", f"is outside staging root {root}"),
        ("s3://bkt/deep/stage/../x", "contains a '..' segment"),
    ]
    for path, reason in cases:
        with _raises(StagingPathError, f"{path!r} {reason}"):
            staging.delete(path)
        with _raises(StagingPathError, f"{path!r} {reason}"):
            staging.retire(path, owned=True)
    assert staging._confine("s3://bkt/deep/stage/exp1/step_00000001") == "bkt/deep/stage/exp1/step_00000001"
    assert staging._confine("s3a://bkt/deep/stage//exp1/./step_00000001") == "bkt/deep/stage/exp1/step_00000001"
    assert staging._confine("s3://bkt/deep/stage/x://y") == "bkt/deep/stage/x:/y"
    bucket_root = Staging("s3://bkt", storage_options={"endpoint_url": "http://127.0.0.1:9"})
    assert bucket_root._confine("s3://bkt/exp1/step_00000001") == "bkt/exp1/step_00000001"


@pytest.mark.parametrize("below", ["exp1/not-a-step", "exp1/x/step_00000001", "step_00000001", "Exp1/step_00000001",
                                   "exp1/step_0000001"])
def test_retire_needs_a_run_step_path(tmp_path: Path, below: str) -> None:
    staging = _local(tmp_path)
    with _raises(StagingPathError, f"{below!r} is not <run>/step_<step> under staging root {staging.root}"):
        staging.retire(f"{staging.root}/{below}", owned=True)


# ---- list --------------------------------------------------------------------------------------


def test_list_reports_every_field_and_skips_what_is_no_snapshot(tmp_path: Path) -> None:
    staging = _local(tmp_path, keep_snapshots=5)
    root = Path(staging.root)
    done, retired, broken = (Path(_stage(staging, s)) for s in (1, 3, 10))
    (retired / RETIRED).write_text("2024-01-01T00:00:00+00:00")
    (broken / MARKER).unlink()
    other = Path(_stage(staging, 2, run="exp2"))
    empty = root / "exp1" / "step_00000005"
    empty.mkdir()
    odd = root / "exp1" / "step_00000007"  # look-alikes of the retired mark only
    odd.mkdir()
    (odd / ".retiredX").write_text("")
    (odd / ".retired ").write_text("")
    (root / "exp1" / "step_1").mkdir()  # not 8 digits
    (root / "exp1" / "step_00000099").write_text("a file, not a snapshot")
    (root / "exp1" / "notes.txt").write_text("")
    (root / "README").write_text("")
    for key in ("Exp1", "exp1X", "exp1 "):  # no run's key: never listed, never read as exp1
        _stage(staging, 4, run="exp9")
        (root / "exp9").rename(root / key)
    for i, d in enumerate([done, retired, broken, other, odd]):
        _set_mtimes(d, T0 + i)
    want = [
        StagedSnapshot("exp1", 1, str(done), True, False, T0),
        StagedSnapshot("exp1", 3, str(retired), True, True, T0 + 1),
        StagedSnapshot("exp1", 5, str(empty), False, False, 0.0),
        StagedSnapshot("exp1", 7, str(odd), False, False, T0 + 4),
        StagedSnapshot("exp1", 10, str(broken), False, False, T0 + 2),
        StagedSnapshot("exp2", 2, str(other), True, False, T0 + 3),
    ]
    assert staging.list() == want
    assert staging.list("exp1") == want[:5]
    assert staging.list("exp2") == want[5:]
    assert staging.list("absent") == []
    assert Staging(str(tmp_path / "nothing-here"), cache_dir=tmp_path / "cache").list() == []


def test_list_on_s3_is_ordered_by_run_then_numeric_step(s3: S3Server, tmp_path: Path) -> None:
    staging = _s3(s3, tmp_path)
    big, small = _stage(staging, 123456789), _stage(staging, 99999999)  # listed lexically: big first
    other = _stage(staging, 2, run="exp2")
    bucket, prefix = staging.root_path.split("/", 1)
    client = s3.client()
    client.put_object(Bucket=bucket, Key=f"{prefix}/exp1/step_99999999/{RETIRED}", Body=b"stamp")
    for key in ("Exp1/step_00000001/x", "exp1/a-notes", "exp1/step_1/x", "exp1 /step_00000001/x"):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=b"")  # sorted before what follows

    def mtime(url: str) -> float:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=url.split("/", 3)[3] + "/")["Contents"]
        return max(o["LastModified"].timestamp() for o in listed)

    assert staging.list() == [
        StagedSnapshot("exp1", 99999999, small, True, True, mtime(small)),
        StagedSnapshot("exp1", 123456789, big, True, False, mtime(big)),
        StagedSnapshot("exp2", 2, other, True, False, mtime(other)),
    ]


def test_check_requires_the_marker_unless_told_not_to(tmp_path: Path) -> None:
    staging = _local(tmp_path)
    url = _stage(staging, 1)
    Path(url, MARKER).unlink()
    assert staging.check(url).complete is False
    assert staging.check(url).problem == "missing_marker"
    assert staging.check(url, require_marker=False).complete is True


# ---- delete and put --------------------------------------------------------------------------


def test_delete_removes_the_marker_first_and_only_that_snapshot(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    staging = _local(tmp_path)
    gone, kept = _stage(staging, 1), _stage(staging, 2)
    rest = sorted(set(os.listdir(gone)) - {MARKER})
    seen: list[list[str]] = []
    monkeypatch.setattr(confined, "before_delete", lambda parent, name: seen.append(sorted(os.listdir(gone))))
    staging.delete(gone)
    assert not Path(gone).exists() and check_snapshot(kept).complete
    assert seen == [rest]  # the marker was already gone when the tree delete began
    staging.delete(gone)  # a second retirer's delete finds nothing: no error


def test_delete_on_s3_removes_the_whole_snapshot(s3: S3Server, tmp_path: Path) -> None:
    staging = _s3(s3, tmp_path)
    gone, kept = _stage(staging, 1), _stage(staging, 2)
    staging.delete(gone)
    fs, _ = resolve(gone, staging.storage_options)
    assert not fs.exists(gone) and staging.check(kept).complete
    staging.delete(gone)  # already gone: no error


def test_put_copies_a_complete_snapshot_marker_last(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_snapshot(named_tensors(seed=5), str(src))
    (src / "sub").mkdir()  # not a file: not copied
    link = tmp_path / "src-link"
    link.symlink_to(src, target_is_directory=True)
    staging = _local(tmp_path)
    dest = staging.put(link, "exp1", 4)
    assert dest == staging.path_for("exp1", 4)
    assert _files(dest) == _files(src) and sorted(os.listdir(dest)) == sorted(_files(src))
    assert check_snapshot(dest).complete


def test_put_refuses_an_incomplete_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_snapshot(named_tensors(), str(src))
    (src / MARKER).unlink()
    staging = _local(tmp_path)
    with _raises(SnapshotIncompleteError, f"snapshot {src} is not complete: missing_marker: {MARKER} is missing") as e:
        staging.put(src, "exp1", 1)
    assert e.value.check == check_snapshot(str(src))
    assert not Path(staging.path_for("exp1", 1)).exists()


def test_put_replaces_an_existing_destination(tmp_path: Path) -> None:
    staging = _local(tmp_path)
    dest = _stage(staging, 1, seed=0)
    Path(dest, "stale.bin").write_bytes(b"old")
    src = tmp_path / "src"
    write_snapshot(named_tensors(seed=1), str(src))
    assert staging.put(src, "exp1", 1) == dest
    assert _files(dest) == _files(src)


def test_put_onto_itself_leaves_it_alone(tmp_path: Path) -> None:
    staging = _local(tmp_path)
    dest = _stage(staging, 1)
    before = _inodes(Path(dest))
    assert staging.put(dest, "exp1", 1) == dest
    assert _inodes(Path(dest)) == before and check_snapshot(dest).complete


def test_put_to_s3_and_over_an_existing_one(s3: S3Server, tmp_path: Path) -> None:
    staging = _s3(s3, tmp_path)
    src = tmp_path / "src"
    write_snapshot(named_tensors(seed=3), str(src))
    dest = staging.put(src, "exp1", 2)
    assert dest == staging.path_for("exp1", 2)
    assert _remote_files(staging, dest) == _files(src) and staging.check(dest).complete
    fs, p = resolve(dest, staging.storage_options)
    fs.pipe_file(f"{p}/stale.bin", b"old")
    assert staging.put(src, "exp1", 2) == dest
    assert _remote_files(staging, dest) == _files(src)


def test_a_failed_put_to_s3_removes_what_it_wrote_and_reraises(s3: S3Server, tmp_path: Path) -> None:
    staging = Staging(f"s3://missing-{uuid.uuid4().hex[:12]}/stage", storage_options=s3.storage_options)
    src = tmp_path / "src"
    write_snapshot(named_tensors(), str(src))
    with pytest.raises(FileNotFoundError):
        staging.put(src, "exp1", 1)


def test_a_failed_local_put_fails_and_leaves_the_blocker(tmp_path: Path) -> None:
    staging = _local(tmp_path)
    blocker = Path(staging.root, "exp1")  # a file where the run's directory belongs
    blocker.parent.mkdir()
    blocker.write_text("not a dir")
    src = tmp_path / "src"
    write_snapshot(named_tensors(), str(src))
    with pytest.raises((OSError, StagingPathError)):  # the copy's error, or the cleanup's refusal of the path
        staging.put(src, "exp1", 1)
    assert blocker.read_text() == "not a dir"


# ---- retire ------------------------------------------------------------------------------------


def _retired_stamp(url: str) -> datetime:
    return datetime.fromisoformat(Path(url, RETIRED).read_text())


def test_not_owned_is_never_touched(tmp_path: Path) -> None:
    staging = _local(tmp_path, keep_snapshots=0)
    url = _stage(staging, 1)
    assert staging.retire(url, owned=False) == RetireResult(url, owned=False, deleted=[], kept=[url])
    assert sorted(os.listdir(url)) == sorted(_files(url)) and not Path(url, RETIRED).exists()


def test_keep_zero_deletes_at_once_and_only_that_snapshot(tmp_path: Path) -> None:
    ring = _local(tmp_path, keep_snapshots=2)
    old = _stage(ring, 1)
    ring.retire(old, owned=True)
    staging = _local(tmp_path, keep_snapshots=0)
    url = _stage(staging, 2)
    assert staging.retire(url, owned=True) == RetireResult(url, owned=True, deleted=[url], kept=[])
    assert not Path(url).exists() and check_snapshot(old).complete  # the older retired one is not this retire's


def test_keep_ring_of_two(tmp_path: Path) -> None:
    staging = _local(tmp_path, keep_snapshots=2)
    running = _stage(staging, 0)
    p1, p2, p3 = (_stage(staging, s) for s in (1, 2, 3))
    assert staging.retire(p1, owned=True) == RetireResult(p1, owned=True, deleted=[], kept=[p1])
    stamp = _retired_stamp(p1)
    assert stamp.utcoffset() == timedelta(0)
    assert staging.retire(p2, owned=True) == RetireResult(p2, owned=True, deleted=[], kept=[p2, p1])  # exactly 2
    assert staging.retire(p3, owned=True) == RetireResult(p3, owned=True, deleted=[p1], kept=[p3, p2])
    assert not Path(p1).exists() and all(check_snapshot(p).complete for p in (p2, p3, running))
    assert not Path(running, RETIRED).exists()


def test_keep_ring_of_one_keeps_the_newest_step_not_the_latest_retired(tmp_path: Path) -> None:
    staging = _local(tmp_path, keep_snapshots=1)
    p5, p4 = _stage(staging, 5), _stage(staging, 4)
    assert staging.retire(p5, owned=True) == RetireResult(p5, owned=True, deleted=[], kept=[p5])
    assert staging.retire(p4, owned=True) == RetireResult(p4, owned=True, deleted=[p4], kept=[p5])


def test_retire_of_a_missing_snapshot_marks_nothing(tmp_path: Path) -> None:
    staging = _local(tmp_path, keep_snapshots=1)
    kept = _stage(staging, 2)
    staging.retire(kept, owned=True)
    missing = staging.path_for("exp1", 9)
    assert staging.retire(missing, owned=True) == RetireResult(missing, owned=True, deleted=[], kept=[kept])
    assert not Path(missing).exists()


def test_keep_best_protects_the_given_steps_beyond_the_ring(tmp_path: Path) -> None:
    marker = _local(tmp_path, keep_snapshots=9)
    urls = {s: _stage(marker, s) for s in (1, 2, 3, 4, 5)}
    for s in (1, 2, 3, 4):
        marker.retire(urls[s], owned=True)
    staging = _local(tmp_path, keep_snapshots=1, keep_best=2)
    got = staging.retire(urls[5], owned=True, protect=frozenset({2}))
    assert got == RetireResult(urls[5], owned=True, deleted=[urls[4], urls[3], urls[1]], kept=[urls[5], urls[2]])
    assert sorted(p.name for p in Path(staging.root, "exp1").iterdir()) == ["step_00000002", "step_00000005"]


def test_keep_best_without_protect_deletes_nothing(tmp_path: Path) -> None:
    staging = _local(tmp_path, keep_snapshots=0, keep_best=1)
    p1, p2, p3 = (_stage(staging, s) for s in (1, 2, 3))
    staging.retire(p1, owned=True)
    staging.retire(p2, owned=True)
    assert staging.retire(p3, owned=True) == RetireResult(p3, owned=True, deleted=[], kept=[p3, p2, p1])
    assert all(check_snapshot(p).complete for p in (p1, p2, p3))
    got = staging.retire(p3, owned=True, protect=frozenset({2}))  # keep_snapshots=0: only protected steps stay
    assert got == RetireResult(p3, owned=True, deleted=[p3, p1], kept=[p2])
    assert staging.retire(p2, owned=True, protect=frozenset()) == RetireResult(p2, owned=True, deleted=[p2], kept=[])


def test_retire_on_s3_marks_and_rings(s3: S3Server, tmp_path: Path) -> None:
    staging = _s3(s3, tmp_path, keep_snapshots=1)
    p1, p2 = _stage(staging, 1), _stage(staging, 2)
    assert staging.retire(p1, owned=True) == RetireResult(p1, owned=True, deleted=[], kept=[p1])
    assert staging.retire(p2, owned=True) == RetireResult(p2, owned=True, deleted=[p1], kept=[p2])
    fs, p = resolve(p2, staging.storage_options)
    assert datetime.fromisoformat(fs.cat_file(f"{p}/{RETIRED}").decode()).utcoffset() == timedelta(0)
    assert not fs.exists(resolve(p1, staging.storage_options)[1])
    missing = staging.path_for("exp1", 3)
    assert staging.retire(missing, owned=True) == RetireResult(missing, owned=True, deleted=[], kept=[p2])
    assert not fs.exists(resolve(missing, staging.storage_options)[1])


# ---- materialize -------------------------------------------------------------------------------


def test_materialize_local_is_the_path_itself(tmp_path: Path) -> None:
    staging = _local(tmp_path)
    url = _stage(staging, 1)
    assert staging.materialize(url) == Path(url)
    assert not staging.cache_dir.exists()
    Path(url, MARKER).unlink()
    with _raises(SnapshotIncompleteError, f"snapshot {url} is not complete: missing_marker: {MARKER} is missing"):
        staging.materialize(url)


def test_materialize_s3_into_a_named_entry_reused_until_the_marker_changes(s3: S3Server,
                                                                           tmp_path: Path) -> None:
    staging = _s3(s3, tmp_path)
    staging.cache_dir = tmp_path / "a" / "b" / "cache"  # parents are made
    url = _stage(staging, 7)
    fs, p = resolve(url, staging.storage_options)
    for extra in ("extraX", "extra "):  # names are taken as listed, not trimmed
        fs.pipe_file(f"{p}/{extra}", b"extra")
    entry = staging.materialize(url)
    assert entry == _entry(staging, url)
    assert _files(entry) == _remote_files(staging, url)
    assert sorted(os.listdir(staging.cache_dir)) == [entry.name]  # no download dir left
    before = _inodes(entry)
    assert staging.materialize(url) == entry and _inodes(entry) == before  # reused, not downloaded again
    next(p for p in entry.iterdir() if p.name.endswith(".safetensors")).unlink()
    assert staging.materialize(url) == entry and check_snapshot(str(entry)).complete  # a damaged entry is replaced
    _stage(staging, 7, seed=99)  # a new export at the same url: new marker
    assert staging.materialize(url) == entry
    assert _files(entry) == _remote_files(staging, url)
    assert sorted(os.listdir(staging.cache_dir)) == [entry.name]


def test_materialize_s3_refuses_an_incomplete_remote(s3: S3Server, tmp_path: Path) -> None:
    staging = _s3(s3, tmp_path)
    url = _stage(staging, 1)
    fs, p = resolve(url, staging.storage_options)
    fs.rm_file(f"{p}/{MARKER}")
    with _raises(SnapshotIncompleteError, f"snapshot {url} is not complete: missing_marker: {MARKER} is missing"):
        staging.materialize(url)


def test_materialize_reads_with_the_given_storage_options(s3: S3Server, tmp_path: Path) -> None:
    remote = _s3(s3, tmp_path)
    url = _stage(remote, 3)
    local = _local(tmp_path)  # its own options ({}) cannot reach the S3 endpoint
    entry = local.materialize(url, storage_options=s3.storage_options)
    assert entry == _entry(local, url) and _files(entry) == _remote_files(remote, url)


def test_a_failed_download_leaves_no_temporary_dir(s3: S3Server, tmp_path: Path) -> None:
    staging = _s3(s3, tmp_path)
    url = _stage(staging, 1)
    fs, p = resolve(url, staging.storage_options)
    fs.pipe_file(f"{p}/{'z' * 300}", b"a name no local filesystem takes")  # extra: the snapshot stays complete
    assert staging.check(url).complete
    with pytest.raises(OSError, match="File name too long"):
        staging.materialize(url)
    assert os.listdir(staging.cache_dir) == []


def test_clean_abandoned_tmp_removes_only_dead_pids(tmp_path: Path, live_child: subprocess.Popen[bytes]) -> None:
    staging = _local(tmp_path)
    dead = _dead_pid()
    names = [f".tmp-{dead}-x", f".tmp-{dead}", f".tmp-{live_child.pid}-x", ".tmp-abc-x", f"entry-{dead}-x"]
    for name in names:
        (staging.cache_dir / name).mkdir(parents=True)
        (staging.cache_dir / name / "part").write_bytes(b"x")
    staging._clean_abandoned_tmp()
    assert sorted(os.listdir(staging.cache_dir)) == sorted(names[2:])


def test_pid_alive(live_child: subprocess.Popen[bytes]) -> None:
    assert _pid_alive(live_child.pid) is True
    assert _pid_alive(_dead_pid()) is False
    assert live_child.communicate(b"", timeout=60) == (b"", None)
    assert live_child.returncode == 0  # the probe sent no real signal
    if os.geteuid() != 0 and os.stat("/proc/1").st_uid != os.geteuid():
        assert _pid_alive(1) is True  # another user's process: PermissionError, still alive


def _du(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def test_lru_eviction(s3: S3Server, tmp_path: Path, live_child: subprocess.Popen[bytes]) -> None:
    unbounded = _s3(s3, tmp_path)
    a, b, c, d = (_stage(unbounded, s) for s in (1, 2, 3, 4))
    ea, eb, ec = (unbounded.materialize(u) for u in (a, b, c))
    size = {e: _du(e) for e in (ea, eb, ec)}

    def bounded(max_bytes: int | None) -> Staging:
        return Staging(unbounded.root, storage_options=unbounded.storage_options, cache_dir=unbounded.cache_dir,
                       cache_max_bytes=max_bytes)

    def ages(*entries: Path) -> None:
        for i, e in enumerate(entries):
            os.utime(e, (T0 + i, T0 + i))

    def cached() -> set[str]:
        return {p.name for p in unbounded.cache_dir.iterdir()}

    ages(ea, eb, ec)
    bounded(sum(size.values())).materialize(c)  # exactly at the bound: nothing is evicted
    assert cached() == {ea.name, eb.name, ec.name}
    ages(ea, eb, ec)
    ed = bounded(None).materialize(d)  # unbounded: nothing is evicted
    assert cached() == {ea.name, eb.name, ec.name, ed.name}
    ages(ea, eb, ec)
    bounded(size[ec] + _du(ed)).materialize(d)  # over the bound: oldest first until it fits
    assert cached() == {ec.name, ed.name}
    os.utime(ec, (T0 + 1e9, T0 + 1e9))  # newer than the entry about to be used
    (unbounded.cache_dir / "notes.txt").write_text("not an entry")
    busy = unbounded.cache_dir / f".tmp-{live_child.pid}-busy"
    busy.mkdir()
    (busy / "part").write_bytes(b"x" * 100)
    assert bounded(0).materialize(d) == ed  # the entry just used stays, however old and over the bound
    assert cached() == {ed.name, "notes.txt", busy.name}


def test_each_run_has_its_own_keep_ring(tmp_path: Path) -> None:
    """A retire ranks only its own run's retired snapshots: another run's ring is never trimmed."""
    staging = _local(tmp_path, keep_snapshots=1)
    a1, b1, b2 = _stage(staging, 1, "runa"), _stage(staging, 1, "runb"), _stage(staging, 2, "runb")
    assert staging.retire(a1, owned=True) == RetireResult(a1, owned=True, deleted=[], kept=[a1])
    assert staging.retire(b1, owned=True) == RetireResult(b1, owned=True, deleted=[], kept=[b1])
    assert staging.retire(b2, owned=True) == RetireResult(b2, owned=True, deleted=[b1], kept=[b2])
    assert [(s.run, s.step) for s in staging.list()] == [("runa", 1), ("runb", 2)]
