"""Staging on a shared node: a hostile neighbour cannot make retire/janitor delete outside the root.

The neighbour (`pe-neighbour`, tests/neighbour.py) acts through the system Python; the staging
root lies under `shared_dir` (1777, like /tmp), so a refusal comes from staging's own checks.
The swap races are made deterministic by swapping at a seam between the check and the delete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from pinned_eval.snapshot import confined
from pinned_eval.snapshot.staging import Staging, StagingPathError, UnsafeStagingRootError
from tests.conftest import free_port
from tests.neighbour import Neighbour, run_as
from trainer_integration.client import EvalClient

SYMLINK = "import os, sys; os.symlink(sys.argv[1], sys.argv[2])"
MKDIR = "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o755)"


def _owner_checkpoints(base: Path) -> Path:
    """The owner's real checkpoints, laid out as a staging run would be."""
    ckpts = base / "checkpoints"
    step = ckpts / "exp1" / "step_00000001"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"precious weights")
    (step / ".complete").write_text("")
    return ckpts


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_neighbour_symlink_at_the_root_is_refused_and_nothing_is_deleted(
    neighbour: Neighbour, shared_dir: Path, tmp_path: Path
) -> None:
    ckpts = _owner_checkpoints(tmp_path)
    before = _files(ckpts)
    root = shared_dir / "staging"
    planted = run_as(neighbour, SYMLINK, str(ckpts), str(root))
    assert planted.returncode == 0, planted.stderr
    with pytest.raises(UnsafeStagingRootError) as info:
        staging = Staging(str(root), keep_snapshots=0, cache_dir=tmp_path / "cache")
        staging.retire(staging.path_for("exp1", 1), owned=True)
    assert str(info.value) == f"staging root {str(root)!r} refused: it is a symlink (to {str(ckpts)!r})"
    assert _files(ckpts) == before


def test_symlink_planted_at_the_root_after_construction_is_refused_at_delete(
    neighbour: Neighbour, shared_dir: Path, tmp_path: Path
) -> None:
    """The root did not exist when staging was built; the neighbour plants it before the retire."""
    ckpts = _owner_checkpoints(tmp_path)
    before = _files(ckpts)
    root = shared_dir / "staging"
    staging = Staging(str(root), keep_snapshots=0, cache_dir=tmp_path / "cache")
    assert run_as(neighbour, SYMLINK, str(ckpts), str(root)).returncode == 0
    with pytest.raises(StagingPathError):
        staging.retire(staging.path_for("exp1", 1), owned=True)
    assert _files(ckpts) == before


def test_neighbour_owned_root_is_refused(neighbour: Neighbour, shared_dir: Path, tmp_path: Path) -> None:
    root = shared_dir / "staging"
    made = run_as(neighbour, MKDIR, str(root))
    assert made.returncode == 0, made.stderr
    with pytest.raises(UnsafeStagingRootError) as info:
        Staging(str(root), cache_dir=tmp_path / "cache")
    assert str(info.value) == (
        f"staging root {str(root)!r} refused: it is owned by uid {neighbour.uid}, "
        f"not by this user (uid {os.geteuid()}) or root"
    )


def test_root_writable_by_others_without_sticky_bit_is_refused(
    neighbour: Neighbour, shared_dir: Path, tmp_path: Path
) -> None:
    root = shared_dir / "staging"
    root.mkdir()
    root.chmod(0o777)
    # what the mode lets the neighbour do: plant entries (here a run dir of its own) in the root
    assert run_as(neighbour, MKDIR, str(root / "exp1")).returncode == 0
    with pytest.raises(UnsafeStagingRootError) as info:
        Staging(str(root), cache_dir=tmp_path / "cache")
    why = "it is writable by others without the sticky bit (mode 777)"
    assert str(info.value) == f"staging root {str(root)!r} refused: {why}"
    root.chmod(0o1777)  # with the sticky bit others cannot rename or remove our entries
    assert Staging(str(root), cache_dir=tmp_path / "cache").root == str(root)


def _staged_step(root: Path, run: str = "exp1", step: int = 1) -> Path:
    d = root / run / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"staged")
    (d / ".complete").write_text("")
    return d


def test_run_dir_swapped_for_a_symlink_after_the_check_cannot_escape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between `_confine` (the check) and the delete, `<root>/exp1` becomes a symlink to the
    owner's checkpoints, which hold a `step_00000001` of their own: they must survive."""
    ckpts = _owner_checkpoints(tmp_path)
    before = _files(ckpts)
    root = tmp_path / "stage"
    _staged_step(root)
    staging = Staging(str(root), keep_snapshots=0, cache_dir=tmp_path / "cache")
    checked = Staging._confine

    def confine_then_swap(self: Staging, path: str) -> Any:
        fs_path = checked(self, path)
        shutil.rmtree(root / "exp1")
        (root / "exp1").symlink_to(ckpts / "exp1", target_is_directory=True)
        return fs_path

    monkeypatch.setattr(Staging, "_confine", confine_then_swap)
    with pytest.raises(StagingPathError, match="symlink"):
        staging.delete(staging.path_for("exp1", 1))
    assert _files(ckpts) == before


def test_snapshot_dir_swapped_for_a_symlink_just_before_rmtree_cannot_escape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last component swapped after the descriptor walk: the marker of the real snapshot
    went first, the tree delete refuses the symlink, the outside files survive."""
    ckpts = _owner_checkpoints(tmp_path)
    before = _files(ckpts)
    root = tmp_path / "stage"
    step = _staged_step(root)
    staging = Staging(str(root), keep_snapshots=0, cache_dir=tmp_path / "cache")

    def swap(parent_fd: int, name: str) -> None:
        shutil.rmtree(step)
        step.symlink_to(ckpts / "exp1" / "step_00000001", target_is_directory=True)

    monkeypatch.setattr(confined, "before_delete", swap)
    with pytest.raises(StagingPathError, match="became a symlink"):
        staging.delete(str(step))
    assert _files(ckpts) == before


def test_retire_marks_and_deletes_only_below_the_root(tmp_path: Path) -> None:
    root = tmp_path / "stage"
    for s in (1, 2, 3):
        _staged_step(root, step=s)
    staging = Staging(str(root), keep_snapshots=1, cache_dir=tmp_path / "cache")
    staging.retire(staging.path_for("exp1", 1), owned=True)
    staging.retire(staging.path_for("exp1", 2), owned=True)
    assert sorted(p.name for p in (root / "exp1").iterdir()) == ["step_00000002", "step_00000003"]
    assert (root / "exp1" / "step_00000002" / ".retired").is_file()
    assert not (root / "exp1" / "step_00000003" / ".retired").exists()


@pytest.mark.parametrize("sibling", ["stage-evil", "stageevil"])
def test_sibling_prefix_of_a_local_root_is_refused(tmp_path: Path, sibling: str) -> None:
    evil = tmp_path / sibling / "exp1" / "step_00000001"
    evil.mkdir(parents=True)
    (evil / "keep.txt").write_text("not staging's")
    staging = Staging(str(tmp_path / "stage"), keep_snapshots=0, cache_dir=tmp_path / "cache")
    for op in (staging.delete, lambda p: staging.retire(p, owned=True)):
        with pytest.raises(StagingPathError, match="outside staging root"):
            op(str(evil))
    assert (evil / "keep.txt").read_text() == "not staging's"


def test_trainer_export_into_a_root_a_neighbour_symlinked_is_skipped_not_written_or_raised(
    neighbour: Neighbour, shared_dir: Path, tmp_path: Path
) -> None:
    """The trainer's staging root did not exist yet; the neighbour planted a symlink there to the
    owner's checkpoints. The in-loop export must not write through it, and the loop goes on."""
    ckpts = _owner_checkpoints(tmp_path)
    before = _files(ckpts)
    root = shared_dir / "staging"
    assert run_as(neighbour, SYMLINK, str(ckpts), str(root)).returncode == 0
    exported: list[int] = []

    def export(step: int, dest: str) -> None:
        exported.append(step)
        Path(dest).mkdir(parents=True)
        (Path(dest) / "model.safetensors").write_bytes(b"overwrites the owner's")

    dead = f"http://127.0.0.1:{free_port()}/api"
    with EvalClient("exp1", dead, spool_dir=tmp_path / "spool", staging_root=root, exporter=export,
                    startup_sync_s=5) as client:
        result = client.dispatch(1)
        [record] = client.spool.pending()
    assert result.action == "skipped_export_failed" and exported == []
    assert (record.kind, record.step) == ("skip_record", 1)
    assert _files(ckpts) == before
