"""No code or paths from payloads (fast half): a point request names no class path or options,
a source outside the staging block's roots is refused naming its field (after resolving
symlinks), the Megatron reader never unpickles a `.metadata` reached through a symlink leaving
the checkpoint, and a run name matches in full (no trailing newline)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from pydantic import ValidationError

from pinned_eval.points import PointRequest, SnapshotSource
from pinned_eval.snapshot.staging import Staging, StagingPathError

HF = {"kind": "hf", "path": "/ckpt/step_1"}


class _Plant:
    """Unpickling it creates `marker`: proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def plant_megatron_checkpoint(ckpt: Path, marker: Path) -> Path:
    """A torch_dist-looking directory whose `.metadata` pickle creates `marker` when loaded."""
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    return ckpt


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"backend": "os:system"}, "backend"),
        ({"backend_options": {"command": "id"}}, "backend_options"),
    ],
)
def test_a_request_naming_a_class_path_or_options_is_refused_naming_the_field(extra: dict, field: str) -> None:
    payload = {"run": "exp42", "step": 1, "source": HF, **extra}  # otherwise a valid request
    with pytest.raises(ValidationError) as info:
        PointRequest.model_validate(payload)
    assert [(e["loc"], e["type"]) for e in info.value.errors()] == [((field,), "extra_forbidden")]


def test_the_external_posture_names_a_saved_block_only() -> None:
    req = PointRequest(run="exp42", step=1, source=SnapshotSource(kind="hf", path="/c"), posture="external",
                       backend_block="sglang-cpu")
    assert req.model_dump(mode="json")["backend_block"] == "sglang-cpu"
    with pytest.raises(ValidationError, match="backend_block"):
        PointRequest(run="exp42", step=1, source=SnapshotSource(kind="hf", path="/c"), posture="external")
    with pytest.raises(ValidationError, match="backend_block"):  # a block name, not a dotted path
        PointRequest(run="exp42", step=1, source=SnapshotSource(kind="hf", path="/c"), posture="external",
                     backend_block="tests.evil:Evil")


def test_run_names_with_a_trailing_newline_are_refused_everywhere(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="run"):
        PointRequest(run="exp42\n", step=1, source=SnapshotSource(kind="hf", path="/c"))
    staging = Staging(str(tmp_path))
    assert staging.path_for("exp42", 1) == str(tmp_path / "exp42" / "step_00000001")
    with pytest.raises(StagingPathError, match="run 'exp42\\\\n'"):
        staging.path_for("exp42\n", 1)


def test_sources_are_confined_to_the_roots_after_resolving_symlinks(tmp_path: Path) -> None:
    from pinned_eval.source_roots import SourceOutsideRoots, confine_source

    allowed, other = tmp_path / "allowed", tmp_path / "other"
    (allowed / "ckpt").mkdir(parents=True)
    other.mkdir()
    (allowed / "escape").symlink_to(other)
    roots = [str(tmp_path / "stage"), str(allowed), "s3://bucket/prefix"]

    confine_source(SnapshotSource(kind="hf", path=str(allowed / "ckpt")), roots)
    confine_source(SnapshotSource(kind="hf", path="s3://bucket/prefix/run/step_1"), roots)
    confine_source(SnapshotSource(kind="state_dict", path=str(allowed / "w.pt"), hf_base=str(allowed)), roots)
    refused = {
        "/etc": ("source.path", "/etc"),
        str(other / "ckpt"): ("source.path", str(other / "ckpt")),
        str(allowed / "escape" / "ckpt"): ("source.path", "resolves to"),  # a symlink inside a root
        str(allowed / ".." / "other"): ("source.path", "resolves to"),
        str(tmp_path / "allowed-not"): ("source.path", "allowed-not"),  # a root is a directory, not a prefix
        "s3://bucket/prefixed/x": ("source.path", "s3://bucket/prefixed/x"),
        "s3://bucket/prefix/../other": ("source.path", "s3://bucket/prefix/../other"),
        "s3://other/prefix/x": ("source.path", "s3://other"),
        "http://127.0.0.1:9/ckpt": ("source.path", "http://"),
    }
    for path, (field, shown) in refused.items():
        with pytest.raises(SourceOutsideRoots) as info:
            confine_source(SnapshotSource(kind="hf", path=path), roots)
        assert str(info.value).startswith(f"{field}: ") and shown in str(info.value), path
    with pytest.raises(SourceOutsideRoots, match=r"^source\.hf_base: '/etc'"):
        confine_source(SnapshotSource(kind="megatron", path=str(allowed / "ckpt"), hf_base="/etc"), roots)


def test_megatron_reader_never_unpickles_metadata_through_an_escaping_symlink(tmp_path: Path) -> None:
    from pinned_eval.snapshot.mcore_checkpoint import CheckpointNotFound, TorchDistReader

    marker = tmp_path / "unpickled"
    planted = plant_megatron_checkpoint(tmp_path / "elsewhere" / "ckpt", marker)
    ckpt = tmp_path / "root" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").symlink_to(planted / ".metadata")
    with pytest.raises(CheckpointNotFound, match=r"\.metadata resolves outside the checkpoint"):
        TorchDistReader(ckpt)
    saved = tmp_path / "root" / "save"  # a Megatron-LM save root whose iteration dir is a symlink out
    saved.mkdir()
    (saved / "latest_checkpointed_iteration.txt").write_text("release")
    (saved / "release").symlink_to(planted)
    with pytest.raises(CheckpointNotFound, match="release resolves outside the checkpoint"):
        TorchDistReader(saved)
    assert not marker.exists(), "the planted pickle was loaded"
