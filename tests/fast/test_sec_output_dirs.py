"""`tiny-model --out` and `export --out` write only a directory they create (or their own earlier output).

Before the fix both wrote into any existing directory: the current one for an empty value, `/`,
`/etc`, a symlink's target (a neighbour's `out -> victim` link in a shared directory: tiny-model
overwrote the victim's `config.json` and added `.complete`, export deleted the victim's weights).
Refusals are one line on stderr, exit 2, no traceback, nothing written.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from safetensors.torch import save_file
from typer.testing import CliRunner

from app.cli import app
from tests.neighbour import Neighbour, run_as
from tests.snapshot_fixtures import perturbed_state_dict, tiny_hf_base

SYMLINK = "import os, sys; os.symlink(sys.argv[1], sys.argv[2])"
MKDIR = "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)"


def _victim(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    victim = tmp_path / "victim"
    victim.mkdir()
    files = {"config.json": b'{"mine": true}', "model.safetensors": b"precious weights", "notes.txt": b"keep"}
    for name, data in files.items():
        (victim / name).write_bytes(data)
    return victim, files


def _contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()}


def _refused(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # typer.Exit: no traceback
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    return line


def test_tiny_model_never_writes_through_a_neighbours_symlink(
    neighbour: Neighbour, shared_dir: Path, tmp_path: Path
) -> None:
    victim, files = _victim(tmp_path)
    out = shared_dir / "out"
    assert run_as(neighbour, SYMLINK, str(victim), str(out)).returncode == 0
    assert _refused(["tiny-model", "--out", str(out)]) == (
        f"error: --out {str(out)!r} already exists as a symlink; give a new directory")
    assert _contents(victim) == files


def test_tiny_model_never_writes_into_a_directory_a_neighbour_made(
    neighbour: Neighbour, shared_dir: Path
) -> None:
    out = shared_dir / "tiny"
    assert run_as(neighbour, MKDIR, str(out)).returncode == 0
    assert _refused(["tiny-model", "--out", str(out)]) == (
        f"error: --out {str(out)!r} already exists and is not this user's directory; give a new directory")
    assert list(out.iterdir()) == []


def test_tiny_model_refuses_an_empty_value_naming_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("keep")
    assert _refused(["tiny-model", "--out", ""]) == (
        "error: --out: an empty value names the current directory; give a new directory")
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


# `/` and `/etc` were written into before the fix: never run these against the old code as root
@pytest.mark.parametrize(("out", "said"), [
    ("/", "already exists and holds files this command did not write"),
    ("/etc", "already exists and holds files this command did not write"),
    ("/proc/self", "already exists as a symlink"),
    ("/proc/self/fd", "already exists and holds files this command did not write"),
])
def test_tiny_model_refuses_system_directories(out: str, said: str) -> None:
    assert _refused(["tiny-model", "--out", out]) == f"error: --out {out!r} {said}; give a new directory"
    assert not Path(out, ".complete").exists()


def test_tiny_model_writes_a_new_private_directory_and_rewrites_its_own(tmp_path: Path) -> None:
    out = tmp_path / "new" / "tiny"
    for _ in range(2):  # the second run rewrites the first's output in place
        result = CliRunner().invoke(app, ["tiny-model", "--out", str(out)])
        assert (result.exit_code, result.stdout) == (0, f"{out}\n"), result.output
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    (out / "notes.txt").write_text("mine now")  # no longer only tiny-model's files: refused
    assert _refused(["tiny-model", "--out", str(out)]).endswith("holds files this command did not write; "
                                                                "give a new directory")


def test_export_never_deletes_or_writes_through_a_neighbours_symlink(
    neighbour: Neighbour, shared_dir: Path, tmp_path: Path
) -> None:
    llama = tiny_hf_base(tmp_path / "base", "llama")
    save_file(perturbed_state_dict(llama, seed=5), str(tmp_path / "w.safetensors"))
    victim, files = _victim(tmp_path)
    out = shared_dir / "export"
    assert run_as(neighbour, SYMLINK, str(victim), str(out)).returncode == 0
    line = _refused(["export", "--state-dict", str(tmp_path / "w.safetensors"), "--hf-base", str(llama),
                     "--out", str(out)])
    assert line == f"error: --out {str(out)!r} already exists as a symlink; give a new directory"
    assert _contents(victim) == files
    # a new directory is written, and a second export over its own output is allowed
    mine = tmp_path / "mine"
    for _ in range(2):
        result = CliRunner().invoke(app, ["export", "--state-dict", str(tmp_path / "w.safetensors"),
                                          "--hf-base", str(llama), "--out", str(mine)])
        assert result.exit_code == 0, result.output
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
