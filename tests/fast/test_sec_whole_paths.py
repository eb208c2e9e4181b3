"""Every path the product writes, deletes or reads a score from is checked as a whole, and what it
reads back carries the point it was written for.

The neighbour (`pe-neighbour`, tests/neighbour.py) acts through the system Python under
`shared_dir` (1777, like /tmp). Before the fix: a neighbour's `team -> victim` symlink above a
staging root made retire delete the victim's checkpoints; a `results_root` (or a run/step
directory) a neighbour created first let a planted `generations.parquet` turn a measured 0.0 into
a rescored 1.0.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prefect.logging import disable_run_logger

from app.commands._cli import CliError
from app.commands.results import rescore_point
from blocks import EvalSuiteBlock, SinksBlock
from pinned_eval.results.store import GENERATIONS, ResultsKeyError, ResultsStore
from pinned_eval.results.tables import generation_row, generations_table
from pinned_eval.sinks import JsonlSink
from pinned_eval.snapshot.staging import Staging, StagingPathError, UnsafeStagingRootError
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults
from pinned_eval.trusted_paths import UntrustedPathError, check_trusted, make_private_dirs
from tests.neighbour import Neighbour, run_as

SYMLINK = "import os, sys; os.symlink(sys.argv[1], sys.argv[2])"
# the neighbour's directories, open to everyone (as a careless or hostile `mkdir -m 777`)
MAKEDIRS = "import os, sys\nfor d in sys.argv[1:]:\n    os.mkdir(d); os.chmod(d, 0o777)"
PLANT = "import shutil, sys; shutil.copyfile(sys.argv[1], sys.argv[2])"
SUITE = EvalSuite(
    datasets=(DatasetSpec(name="arith_add", path="builtin:arith_add.jsonl", max_prompts=1),),
    defaults=SamplingDefaults(temperature=0.0, max_new_tokens=3, n_samples_per_prompt=1, reward="exact_match"),
)


def _gen(response: str) -> dict[str, object]:
    return {"dataset": "arith_add", "prompt_index": 0, "sample_index": 0, "prompt": "0+0=", "label": "0",
            "metadata": {}, "response": response, "response_len": 1, "finish_reason": "stop",
            "weight_version": "5"}


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _world_readable_copy(shared: Path, name: str, data: bytes) -> Path:
    """A file the neighbour can read (the pytest tmp dir is 0700), removed with `shared`."""
    src = shared / name
    src.write_bytes(data)
    src.chmod(0o644)
    return src


def test_a_neighbours_symlink_above_the_staging_root_is_refused_and_nothing_is_deleted(
    neighbour: Neighbour, shared_dir: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    step = victim / "ckpts" / "exp1" / "step_00000001"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"precious weights")
    (step / ".complete").write_text("")
    before = _files(victim)
    team = shared_dir / "team"
    assert run_as(neighbour, SYMLINK, str(victim), str(team)).returncode == 0
    root = str(team / "ckpts")
    with pytest.raises(UnsafeStagingRootError) as info:
        staging = Staging(root, keep_snapshots=0, cache_dir=tmp_path / "cache")
        staging.retire(staging.path_for("exp1", 1), owned=True)
    assert str(info.value) == (
        f"staging root {root!r} refused ({str(team)!r} on the way to it): it is a symlink owned by uid "
        f"{neighbour.uid}, not by this user (uid {os.geteuid()}) or root"
    )
    assert _files(victim) == before


def test_a_run_dir_a_neighbour_made_in_a_shared_staging_root_is_never_written(
    neighbour: Neighbour, shared_dir: Path, tmp_path: Path
) -> None:
    """The staging root is a sticky shared directory: the neighbour squats the run's directory, to
    swap the weights a point will pin. Neither `put` nor an export writes below it."""
    import torch

    from pinned_eval.snapshot.errors import ExportPathError
    from pinned_eval.snapshot.writer import write_snapshot

    src = tmp_path / "src"
    write_snapshot([("w", torch.zeros(4))], str(src))
    assert run_as(neighbour, MAKEDIRS, str(shared_dir / "exp1")).returncode == 0
    staging = Staging(str(shared_dir), cache_dir=tmp_path / "cache")
    dest = staging.path_for("exp1", 5)
    said = f"staging path {dest!r} refused ({str(shared_dir / 'exp1')!r}): it is owned by uid {neighbour.uid}"
    with pytest.raises(StagingPathError, match=f"^{re.escape(said)}"):
        staging.put(src, "exp1", 5)
    with pytest.raises(ExportPathError, match=re.escape(f"({str(shared_dir / 'exp1')!r}): it is owned by uid")):
        write_snapshot([("w", torch.zeros(4))], dest)
    assert list((shared_dir / "exp1").iterdir()) == []


def _rescore(store_root: Path, tmp_path: Path) -> dict[str, dict[str, float]]:
    sinks = SinksBlock(jsonl_path=str(tmp_path / "m.jsonl"), results_root=str(store_root))
    return rescore_point("exp1", 5, EvalSuiteBlock(suite=SUITE), sinks)


def _planted(tmp_path: Path, shared: Path) -> Path:
    """A generations file stamped for exp1 step 5 whose answer is right (the victim's was wrong)."""
    forged = ResultsStore(str(tmp_path / "forge"))
    forged.write("exp1", 5, GENERATIONS, generations_table([generation_row(_gen("0"))], "k"))
    data = (tmp_path / "forge" / "exp1" / "step_00000005" / GENERATIONS).read_bytes()
    return _world_readable_copy(shared, "planted.parquet", data)


def test_a_results_root_a_neighbour_created_first_is_never_written_or_rescored(
    neighbour: Neighbour, shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = shared_dir / "results"
    step_dir = root / "exp1" / "step_00000005"
    made = run_as(neighbour, MAKEDIRS, str(root), str(root / "exp1"), str(step_dir))
    assert made.returncode == 0, made.stderr
    store = ResultsStore(str(root))
    with pytest.raises(UntrustedPathError) as info:  # the victim's point: measured 0.0, stored here
        store.write("exp1", 5, GENERATIONS, generations_table([generation_row(_gen("wrong"))], "k"))
    assert str(info.value) == (
        f"results_root {str(root)!r} refused: it is owned by uid {neighbour.uid}, "
        f"not by this user (uid {os.geteuid()}) or root"
    )
    planted = _planted(tmp_path, shared_dir)
    assert run_as(neighbour, PLANT, str(planted), str(step_dir / GENERATIONS)).returncode == 0
    with pytest.raises(CliError) as exit_info:  # the CLI boundary prints `error: <message>`, exit 1
        _rescore(root, tmp_path)
    assert exit_info.value.code == 1
    assert exit_info.value.message == (
        f"results file {str(step_dir / GENERATIONS)!r} refused ({str(root)!r}): it is owned by uid "
        f"{neighbour.uid}, not by this user (uid {os.geteuid()}) or root"
    )
    assert not (tmp_path / "m.jsonl").exists()  # nothing recorded


def test_a_run_dir_a_neighbour_created_under_a_shared_results_root_is_never_used(
    neighbour: Neighbour, shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """results_root is a sticky shared directory (like /tmp): the neighbour squats the run's dir."""
    run_dir = shared_dir / "exp1"
    step_dir = run_dir / "step_00000005"
    assert run_as(neighbour, MAKEDIRS, str(run_dir), str(step_dir)).returncode == 0
    store = ResultsStore(str(shared_dir))
    with pytest.raises(UntrustedPathError, match=f"^results_root {str(step_dir)!r} refused \\({str(run_dir)!r}\\)"):
        store.write("exp1", 5, GENERATIONS, generations_table([generation_row(_gen("wrong"))], "k"))
    assert run_as(neighbour, PLANT, str(_planted(tmp_path, shared_dir)), str(step_dir / GENERATIONS)).returncode == 0
    with pytest.raises(CliError) as exit_info:
        _rescore(shared_dir, tmp_path)
    assert "refused" in exit_info.value.message and not (tmp_path / "m.jsonl").exists()


def test_directories_the_product_creates_are_private_and_the_neighbour_cannot_list_them(
    neighbour: Neighbour, shared_dir: Path, tmp_path: Path
) -> None:
    store = ResultsStore(str(shared_dir / "results"))
    store.write("exp1", 5, GENERATIONS, generations_table([generation_row(_gen("0"))], "k"))
    staging_dir = shared_dir / "staging" / "a" / "b"
    old = os.umask(0)  # whatever the umask: 0700
    try:
        make_private_dirs(str(staging_dir), "staging path")
    finally:
        os.umask(old)
    results = shared_dir / "results"
    for d in (results, results / "exp1", results / "exp1" / "step_00000005",
              shared_dir / "staging", shared_dir / "staging" / "a", staging_dir):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    listed = run_as(neighbour, "import os, sys; os.listdir(sys.argv[1])", str(shared_dir / "results"))
    assert listed.returncode == 1 and "PermissionError" in listed.stderr


def test_a_group_writable_ancestor_is_refused(tmp_path: Path) -> None:
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o775)
    with pytest.raises(UntrustedPathError) as info:
        check_trusted(str(group / "results"), "results_root")
    assert str(info.value) == (f"results_root {str(group / 'results')!r} refused ({str(group)!r}): it is writable "
                               f"by its group (gid {group.stat().st_gid}) without the sticky bit (mode 775)")
    group.chmod(0o1775)
    check_trusted(str(group / "results"), "results_root")


def test_a_file_written_for_another_point_is_refused_by_read_rescore_and_the_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tasks.results import cached_generations

    root = tmp_path / "results"
    store = ResultsStore(str(root))
    store.write("exp1", 4, GENERATIONS, generations_table([generation_row(_gen("0"))], "k"))
    (root / "exp1" / "step_00000005").mkdir(mode=0o700)
    shutil.copyfile(root / "exp1" / "step_00000004" / GENERATIONS, root / "exp1" / "step_00000005" / GENERATIONS)
    with pytest.raises(ResultsKeyError) as info:
        store.read("exp1", 5, GENERATIONS)
    assert str(info.value) == (
        f"{root / 'exp1' / 'step_00000005' / GENERATIONS} was not written for exp1 step 5 (it names "
        f'{json.dumps({"run": "exp1", "step": 4})}); refusing to read it: rerun the point to write it again'
    )
    with pytest.raises(CliError) as exit_info:
        _rescore(root, tmp_path)
    assert "was not written for exp1 step 5" in exit_info.value.message
    with disable_run_logger():
        assert cached_generations.fn(store, "exp1", 5, "k") is None
        assert cached_generations.fn(store, "exp1", 4, "k") is not None
    # a file with no point at all (not written by the store) is refused the same way
    pq.write_table(generations_table([generation_row(_gen("0"))], "k"), root / "exp1" / "step_00000005" / GENERATIONS)
    with pytest.raises(ResultsKeyError, match="it names no point"):
        store.read("exp1", 5, GENERATIONS)
    assert not (tmp_path / "m.jsonl").exists()


def test_the_owners_own_point_still_rescores(tmp_path: Path) -> None:
    root = tmp_path / "results"
    ResultsStore(str(root)).write("exp1", 5, GENERATIONS, generations_table([generation_row(_gen("0"))], "k"))
    assert _rescore(root, tmp_path)["arith_add"]["eval/arith_add"] == 1.0
    assert [r.metrics["eval/rescored"] for r in JsonlSink(str(tmp_path / "m.jsonl")).read("exp1")] == [1.0]


def test_the_users_own_symlink_is_followed_and_its_target_checked(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    check_trusted(str(tmp_path / "link" / "results"), "results_root")  # the user's link, a trusted target
    real.chmod(0o777)
    with pytest.raises(UntrustedPathError) as info:
        check_trusted(str(tmp_path / "link" / "results"), "results_root")
    assert str(info.value) == (f"results_root {str(tmp_path / 'link' / 'results')!r} refused ({str(real)!r}): "
                               "it is writable by others without the sticky bit (mode 777)")
