"""Local staging: deletes never leave the root (symlinks, `..`, relative and foreign paths)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pinned_eval.snapshot.staging import SnapshotIncompleteError, Staging, StagingPathError
from pinned_eval.snapshot.writer import write_snapshot
from tests.snapshot_fixtures import named_tensors


@pytest.fixture
def staged(tmp_path: Path) -> tuple[Staging, Path]:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("do not delete")
    return Staging(str(tmp_path / "stage"), keep_snapshots=0, cache_dir=tmp_path / "cache"), outside


def test_symlinked_snapshot_dir_is_refused(staged: tuple[Staging, Path]) -> None:
    staging, outside = staged
    link = Path(staging.path_for("exp1", 1))
    link.parent.mkdir(parents=True)
    link.symlink_to(outside, target_is_directory=True)
    with pytest.raises(StagingPathError, match="symlink"):
        staging.delete(str(link))
    with pytest.raises(StagingPathError, match="symlink"):
        staging.retire(str(link), owned=True)
    assert (outside / "keep.txt").exists()


def test_symlinked_run_dir_pointing_out_is_refused(staged: tuple[Staging, Path]) -> None:
    staging, outside = staged
    (outside / "step_00000001").mkdir()
    Path(staging.root).mkdir(parents=True)
    (Path(staging.root) / "exp1").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StagingPathError, match="outside staging root"):
        staging.delete(staging.path_for("exp1", 1))
    assert (outside / "step_00000001").is_dir()


@pytest.mark.parametrize("path", ["stage/exp1/step_00000001", "../precious", "s3://b/stage/exp1"])
def test_relative_dotdot_and_remote_paths_are_refused(staged: tuple[Staging, Path], path: str) -> None:
    staging, outside = staged
    with pytest.raises(StagingPathError):
        staging.delete(path)
    assert (outside / "keep.txt").exists()


def test_dotdot_inside_an_absolute_path_is_refused(staged: tuple[Staging, Path]) -> None:
    staging, outside = staged
    with pytest.raises(StagingPathError, match=r"'\.\.'"):
        staging.delete(f"{staging.root}/exp1/../../precious")
    assert (outside / "keep.txt").exists()


def test_retire_needs_a_run_step_path(staged: tuple[Staging, Path]) -> None:
    staging, _ = staged
    odd = Path(staging.root) / "exp1" / "not-a-step"
    odd.mkdir(parents=True)
    with pytest.raises(StagingPathError, match="run>/step_"):
        staging.retire(str(odd), owned=True)
    assert odd.is_dir()


def test_path_for_validates(staged: tuple[Staging, Path]) -> None:
    staging, _ = staged
    assert staging.path_for("exp-1_a", 12).endswith("/exp-1_a/step_00000012")
    for run in ("../x", "a/b", "", "a..b", "a b"):
        with pytest.raises(StagingPathError):
            staging.path_for(run, 1)
    with pytest.raises(StagingPathError):
        staging.path_for("exp1", -1)


def test_materialize_local_checks_first(staged: tuple[Staging, Path]) -> None:
    staging, _ = staged
    url = staging.path_for("exp1", 2)
    write_snapshot(named_tensors(), url)
    assert str(staging.materialize(url)) == url
    Path(url, ".complete").unlink()
    with pytest.raises(SnapshotIncompleteError):
        staging.materialize(url)
