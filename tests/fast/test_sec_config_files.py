"""YAML files (`block apply`'s pinned-eval.yaml, miles' eval YAML) go through one reader that reads only
regular files of bounded size and nesting, refuses duplicate keys and never echoes the file's text.

Before the fix: `block apply` hung on a FIFO a neighbour planted at the path, deep nesting raised a
`RecursionError`, a duplicate key silently took the last value, an error echoed the file's first
key verbatim, and a block name ending in a newline was accepted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.block_specs import SpecError, validate_name
from app.commands.init import load_project_config
from pinned_eval.suite import EvalSuite
from tests.neighbour import Neighbour, run_as

MKFIFO = "import os, sys; os.mkfifo(sys.argv[1], 0o666)"
REPO = Path(__file__).resolve().parents[2]


def _apply(path: str) -> subprocess.CompletedProcess[str]:
    """`pinned-eval block apply PATH` in a subprocess: a hang is a timeout, not a stuck suite."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    return subprocess.run([sys.executable, "-m", "app.cli", "block", "apply", path], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)


def test_block_apply_refuses_a_fifo_a_neighbour_planted_at_once(neighbour: Neighbour, shared_dir: Path) -> None:
    fifo = shared_dir / "pinned-eval.yaml"
    assert run_as(neighbour, MKFIFO, str(fifo)).returncode == 0
    done = _apply(str(fifo))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"error: {fifo}: not a regular file (a FIFO); refused\n"


def test_block_apply_refuses_a_device() -> None:
    done = _apply("/dev/null")
    assert (done.returncode, done.stderr) == (2, "error: /dev/null: not a regular file (a character device); refused\n")


def test_deep_nesting_is_a_clear_error_not_a_recursion_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("suite: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ValueError) as info:
        load_project_config(path)
    assert str(info.value) == f"{path}: nested more than 64 levels deep (line 1)"
    with pytest.raises(ValueError) as info:
        EvalSuite.from_miles_yaml(path)
    assert str(info.value) == f"eval config {path}: nested more than 64 levels deep (line 1)"


def test_duplicate_keys_are_refused_naming_the_key_and_lines(tmp_path: Path) -> None:
    path = tmp_path / "pinned-eval.yaml"
    path.write_text("staging:\n  root: /a\n  keep: 1\n  keep: 0\n")
    with pytest.raises(ValueError) as info:
        load_project_config(path)
    assert str(info.value) == f"{path}: duplicate key keep (line 4, first at line 3)"
    miles = tmp_path / "eval.yaml"
    miles.write_text("eval:\n  datasets:\n    - name: a\n      path: a.jsonl\n      name: b\n")
    with pytest.raises(ValueError) as info:
        EvalSuite.from_miles_yaml(miles)
    assert str(info.value) == f"eval config {miles}: duplicate key name (line 5, first at line 3)"


def test_errors_never_echo_the_files_text(tmp_path: Path) -> None:
    secret = "sk-live-4f9a2b7c"
    path = tmp_path / "not-mine.yaml"
    path.write_text(f"{secret}: x\nother: y\n")
    for read, said in ((load_project_config, f"{path}: (a key that is not a name): not a section"),
                       (EvalSuite.from_miles_yaml, "eval.(a key that is not a name): not supported")):
        with pytest.raises(ValueError) as info:
            read(path)
        assert str(info.value).startswith(said) and secret not in str(info.value)


def test_a_file_over_the_size_bound_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("suite: {}\n" + "#" * (1 << 20) + "\n")
    with pytest.raises(ValueError) as info:
        load_project_config(path)
    assert str(info.value) == f"{path}: {path.stat().st_size} bytes, more than the 1048576 a config file may have"


@pytest.mark.parametrize("name", ["default\n", "exp42\n", "a\nb"])
def test_block_names_are_matched_to_the_end(name: str) -> None:
    with pytest.raises(SpecError) as info:
        validate_name(name)
    assert info.value.key == "name" and info.value.message.startswith(f"{name!r} is not a block name")


def test_more_than_100_aliases_and_a_nul_in_the_path_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text("a: &a [1]\nb: [" + ", ".join(["*a"] * 101) + "]\n")
    with pytest.raises(ValueError) as info:
        load_project_config(path)
    assert str(info.value) == f"{path}: more than 100 aliases (line 2)"
    with pytest.raises(ValueError) as info:
        load_project_config(Path("pinned\0eval.yaml"))
    assert str(info.value) == "pinned\0eval.yaml: the path contains a NUL byte"
