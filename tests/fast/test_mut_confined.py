"""Local staging confinement (pinned_eval/snapshot/confined.py): each refusal with its exact reason,
and the deletes and writes below a root (`make mutants` killers, docs/testing.md)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from pinned_eval.snapshot import confined
from pinned_eval.snapshot.confined import StagingPathError, UnsafeStagingRootError


def _root(tmp_path: Path, mode: int = 0o700) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    root.chmod(mode)
    return root


def test_a_missing_root_and_a_private_one_pass(tmp_path: Path) -> None:
    confined.check_root(str(tmp_path / "absent"))
    confined.check_root(str(_root(tmp_path)))
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    confined.check_root(str(sticky))
    confined.check_root("/")  # root's own directory: trusted by any user (a mutant killed only when not root)


def test_each_unsafe_root_is_refused_with_its_reason(tmp_path: Path) -> None:
    root = _root(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(root)
    with pytest.raises(UnsafeStagingRootError) as err:
        confined.check_root(str(link))
    assert str(err.value) == f"staging root {str(link)!r} refused: it is a symlink (to {str(root)!r})"
    plain = tmp_path / "file"
    plain.write_text("x")
    with pytest.raises(UnsafeStagingRootError) as err:
        confined.check_root(str(plain))
    assert str(err.value) == f"staging root {str(plain)!r} refused: it is not a directory"
    root.chmod(0o777)
    with pytest.raises(UnsafeStagingRootError) as err:
        confined.check_root(str(root))
    assert (
        str(err.value)
        == f"staging root {str(root)!r} refused: it is writable by others without the sticky bit (mode 777)"
    )


def test_a_root_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    root = _root(tmp_path)
    os.chown(root, 4242, 4242)
    with pytest.raises(UnsafeStagingRootError) as err:
        confined.check_root(str(root))
    assert str(err.value) == (
        f"staging root {str(root)!r} refused: it is owned by uid 4242, not by this user (uid 0) or root"
    )
    with pytest.raises(UnsafeStagingRootError) as err:
        confined.remove_below(str(root), ["a"])
    assert "it is owned by uid 4242" in str(err.value)


@pytest.mark.parametrize("parts", [[], [""], ["."], [".."], ["a", ".."], ["a/b"]])
def test_only_paths_strictly_below_the_root_are_touched(tmp_path: Path, parts: list[str]) -> None:
    root = _root(tmp_path)
    with pytest.raises(StagingPathError) as err:
        confined.remove_below(str(root), parts)
    assert str(err.value) == f"{parts!r} is not a path strictly below staging root {str(root)!r}"


def test_a_root_replaced_by_a_symlink_is_refused_at_delete(tmp_path: Path) -> None:
    target = _root(tmp_path)
    (target / "a").mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(UnsafeStagingRootError) as err:
        confined.remove_below(str(link), ["a"])
    assert str(err.value) == f"staging root {str(link)!r} refused: it is a symlink or not a directory"
    assert (target / "a").is_dir()


def test_a_symlinked_component_is_never_followed(tmp_path: Path) -> None:
    root = _root(tmp_path)
    outside = tmp_path / "outside"
    (outside / "snap").mkdir(parents=True)
    (root / "run").symlink_to(outside)
    with pytest.raises(StagingPathError) as err:
        confined.remove_below(str(root), ["run", "snap"])
    assert str(err.value) == f"{str(root / 'run')!r} is a symlink or not a directory; staging never follows it"
    (root / "snap").symlink_to(outside / "snap")
    with pytest.raises(StagingPathError) as err:
        confined.remove_below(str(root), ["snap"])
    assert str(err.value) == f"{str(root / 'snap')!r} is a symlink; staging deletes only real directories"
    assert (outside / "snap").is_dir()


def test_remove_below_deletes_a_file_a_tree_and_forgives_a_missing_one(tmp_path: Path) -> None:
    root = _root(tmp_path)
    (root / "run" / "snap" / "sub").mkdir(parents=True)
    (root / "run" / "snap" / "sub" / "w.bin").write_bytes(b"w")
    (root / "run" / "snap" / ".complete").write_text("")
    (root / "run" / "note").write_text("n")
    confined.remove_below(str(root), ["run", "note"])
    assert sorted(p.name for p in (root / "run").iterdir()) == ["snap"]
    confined.remove_below(str(root), ["run", "snap"], first=".complete")
    assert list((root / "run").iterdir()) == []
    confined.remove_below(str(root), ["run", "snap"], first=".complete")  # gone already: no error
    confined.remove_below(str(root), ["absent", "snap"])


def test_the_marker_goes_before_the_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _root(tmp_path)
    snap = root / "snap"
    snap.mkdir()
    (snap / ".complete").write_text("")
    (snap / "w.bin").write_bytes(b"w")
    seen: list[tuple[list[str], str, list[str]]] = []

    def hook(parent_fd: int, name: str) -> None:  # the parent's descriptor and the name about to go
        seen.append((sorted(os.listdir(parent_fd)), name, sorted(os.listdir(snap)) if snap.exists() else []))

    monkeypatch.setattr(confined, "before_delete", hook)
    confined.remove_below(str(root), ["snap"], first=".complete")
    assert seen == [(["snap"], "snap", ["w.bin"])] and not snap.exists()
    (root / "note").write_text("n")
    confined.remove_below(str(root), ["note"])
    assert seen[1] == (["note"], "note", []) and list(root.iterdir()) == []


def test_a_tree_without_its_marker_is_still_removed(tmp_path: Path) -> None:
    root = _root(tmp_path)
    (root / "snap").mkdir()
    (root / "snap" / "w.bin").write_bytes(b"w")
    confined.remove_below(str(root), ["snap"], first=".complete")
    assert list(root.iterdir()) == []


def test_a_tree_another_retirer_removed_first_is_done_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _root(tmp_path)
    (root / "snap").mkdir()
    monkeypatch.setattr(confined, "before_delete", lambda fd, name: shutil.rmtree(name, dir_fd=fd))
    confined.remove_below(str(root), ["snap"])
    assert list(root.iterdir()) == []


def test_write_below_writes_in_place_and_reports_a_gone_directory(tmp_path: Path) -> None:
    root = _root(tmp_path)
    (root / "run").mkdir()
    assert confined.write_below(str(root), ["run"], "m.json", b"one") is True
    assert confined.write_below(str(root), ["run"], "m.json", b"2") is True
    assert (root / "run" / "m.json").read_bytes() == b"2"
    assert stat.S_IMODE((root / "run" / "m.json").stat().st_mode) == 0o644 & ~_umask()
    assert confined.write_below(str(root), ["gone"], "m.json", b"x") is False
    (root / "run" / "link.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(OSError):
        confined.write_below(str(root), ["run"], "link.json", b"x")
    assert not (tmp_path / "elsewhere.json").exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
