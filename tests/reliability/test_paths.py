"""Deletes never leave the staging root: `..`, symlinks, absolute paths, other buckets and prefixes.

Extends tests/fast/test_staging_paths.py (fixed cases) with a property test over generated paths
on a real tree with symlinks pointing out, S3 keys in other buckets and sibling prefixes on moto,
and the flow's own retire task given a path outside staging.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import s3fs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pinned_eval.snapshot.staging import Staging, StagingPathError
from pinned_eval.snapshot.writer import write_snapshot
from tests.s3_fixtures import S3Server
from tests.snapshot_fixtures import named_tensors


def _tree(base: Path) -> tuple[Staging, Path]:
    """root/exp1/step_00000001 (a snapshot), outside/ (must survive), links from inside to outside."""
    outside = base / "outside"
    (outside / "step_00000002").mkdir(parents=True)
    (outside / "keep.txt").write_text("precious")
    (outside / "step_00000002" / "keep.txt").write_text("precious")
    staging = Staging(str(base / "root"), keep_snapshots=0, cache_dir=base / "cache")
    write_snapshot(named_tensors(n=1), staging.path_for("exp1", 1))
    run_dir = Path(staging.root) / "exp1"
    (run_dir / "step_00000002").symlink_to(outside / "step_00000002", target_is_directory=True)
    (Path(staging.root) / "exp2").symlink_to(outside, target_is_directory=True)
    (run_dir / "keep-link").symlink_to(outside / "keep.txt")
    return staging, outside


def _snapshot_of(outside: Path) -> dict[str, bytes]:
    return {str(p.relative_to(outside)): p.read_bytes() for p in outside.rglob("*") if p.is_file()}


_segment = st.sampled_from(
    ["..", ".", "exp1", "exp2", "step_00000001", "step_00000002", "keep-link", "outside", "root", "", "keep.txt", "x"]
)
_prefix = st.sampled_from(["{root}/", "{base}/", "/", "", "file://{root}/", "file://{base}/", "s3://b/", "{root}/../"])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=_prefix, segments=st.lists(_segment, min_size=0, max_size=5), op=st.sampled_from(["delete", "retire"]))
def test_generated_paths_never_delete_outside_the_root(prefix: str, segments: list[str], op: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        staging, outside = _tree(base)
        before = _snapshot_of(outside)
        path = prefix.format(root=staging.root, base=base) + "/".join(segments)
        try:
            if op == "delete":
                staging.delete(path)
            else:
                staging.retire(path, owned=True)
        except StagingPathError:
            pass
        assert _snapshot_of(outside) == before, f"{op}({path!r}) touched files outside the root"
        # and nothing at or above the root itself went away
        assert Path(staging.root).is_dir()
        shutil.rmtree(base / "root", ignore_errors=True)


@pytest.mark.parametrize(
    "path",
    [
        "{outside}",  # absolute, outside
        "{root}/exp1/../../outside",  # `..`
        "{root}/exp2/step_00000002",  # through a symlinked run dir
        "{root}/exp1/step_00000002",  # a symlinked step dir
        "file://{outside}",
        "{root}",  # the root itself is not a snapshot
        "{root}/exp1",  # a run dir is not a snapshot either (retire)
    ],
)
def test_fixed_escapes_are_refused_before_any_delete(tmp_path: Path, path: str) -> None:
    staging, outside = _tree(tmp_path)
    before = _snapshot_of(outside)
    target = path.format(root=staging.root, outside=outside)
    with pytest.raises(StagingPathError):
        staging.retire(target, owned=True)
    assert _snapshot_of(outside) == before
    assert (Path(staging.path_for("exp1", 1)) / ".complete").exists(), "nothing inside was touched either"


@pytest.mark.e2e
def test_s3_keys_outside_the_prefix_are_refused(s3_server: S3Server) -> None:
    bucket, other = s3_server.make_bucket("rel"), s3_server.make_bucket("rel")
    opts = s3_server.storage_options
    staging = Staging(f"s3://{bucket}/stage", storage_options=opts, keep_snapshots=0)
    victims = [
        f"s3://{other}/stage/exp1/step_00000001",
        f"s3://{bucket}/stage-evil/exp1/step_00000001",
        f"s3://{bucket}/other/exp1/step_00000001",
    ]
    for url in victims:
        write_snapshot(named_tensors(n=1), url, storage_options=opts)
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    before = sorted(fs.find(f"s3://{other}") + fs.find(f"s3://{bucket}"))
    attempts = [
        *victims,
        f"s3://{bucket}/stage/../other/exp1/step_00000001",
        f"s3://{bucket}/stage",
        f"s3://{bucket}",
        f"/{bucket}/stage/exp1/step_00000001",
        f"s3://{other}/stage/exp1/../x",
    ]
    for url in attempts:
        with pytest.raises(StagingPathError):
            staging.delete(url)
    assert sorted(fs.find(f"s3://{other}") + fs.find(f"s3://{bucket}")) == before


@pytest.mark.e2e
def test_retire_task_refuses_a_path_outside_staging_and_the_point_stands(prefect_server: str, tmp_path: Path) -> None:
    """The flow's `retire_snapshot` logs the refusal and deletes nothing (an owned source pointing out)."""
    from prefect import flow

    from tasks.snapshots import Snapshot, retire_snapshot

    staging, outside = _tree(tmp_path)
    before = _snapshot_of(outside)
    snap = Snapshot(path=str(outside), owned=True, kind="staged")

    @flow
    def retire_one() -> object:
        return retire_snapshot(snap, staging)

    result = retire_one()
    assert result.deleted == [] and result.kept == [str(outside)]
    assert _snapshot_of(outside) == before
