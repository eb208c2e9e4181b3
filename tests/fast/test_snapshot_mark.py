"""`pinned-eval snapshot mark DIR`: a checkpoint the user already has is checked first and marked
only when complete (a bare `.complete`, which the check then vouches for); refusals give the reason."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import app
from pinned_eval.snapshot.check import check_snapshot


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.fixture
def ckpt(tiny_model: Path, tmp_path: Path) -> Path:
    """A `save_pretrained` checkpoint: no marker."""
    dest = tmp_path / "ckpt"
    shutil.copytree(tiny_model, dest)
    return dest


def test_mark_writes_the_marker_after_checking(ckpt: Path) -> None:
    assert check_snapshot(str(ckpt)).problem == "missing_marker"  # what a point would skip as ckpt_missing
    code, out = cli("snapshot", "mark", str(ckpt))
    assert (code, out.strip()) == (0, f"{ckpt}: marked complete: 1 shards, 460032 tensor bytes")
    assert (ckpt / ".complete").read_bytes() == b""
    assert check_snapshot(str(ckpt)).complete
    code, out = cli("snapshot", "mark", str(ckpt))
    assert (code, out.strip()) == (0, f"{ckpt}: already marked complete: 1 shards, 460032 tensor bytes")


def test_mark_refuses_a_truncated_shard_with_the_reason(ckpt: Path) -> None:
    os.truncate(ckpt / "model.safetensors", 1000)
    code, out = cli("snapshot", "mark", str(ckpt))
    assert (code, out.strip()) == (1, f"error: {ckpt}: not marked: truncated_shard: model.safetensors: header of "
                                      "2136 bytes, file 1000 bytes")
    assert not (ckpt / ".complete").exists()


def test_mark_refuses_a_marker_older_than_the_weights(ckpt: Path) -> None:
    assert cli("snapshot", "mark", str(ckpt))[0] == 0
    shard = ckpt / "model.safetensors"
    later = (ckpt / ".complete").stat().st_mtime + 10
    os.utime(shard, (later, later))  # the weights were rewritten after marking
    code, out = cli("snapshot", "mark", str(ckpt))
    assert (code, out.strip()) == (1, f"error: {ckpt}: not marked: stale_marker: bare .complete is older than "
                                      f"['model.safetensors']; if the files are final, remove {ckpt / '.complete'} "
                                      "and mark again")


def test_mark_refuses_what_is_not_a_local_directory(tmp_path: Path) -> None:
    code, out = cli("snapshot", "mark", str(tmp_path / "nope"))
    assert (code, out.strip()) == (2, f"error: DIRECTORY: {tmp_path / 'nope'} is not a local directory")
    code, out = cli("snapshot", "mark", "s3://bucket/ckpt")
    assert (code, out.strip()) == (2, "error: DIRECTORY: s3://bucket/ckpt is not a local directory")


def test_tiny_model_writes_a_marked_snapshot(tmp_path: Path) -> None:
    out_dir = tmp_path / "tiny"
    (out_dir).mkdir()
    (out_dir / ".complete").write_text("")  # left by an earlier model: removed before writing
    result = CliRunner().invoke(app, ["tiny-model", "--out", str(out_dir)])
    assert (result.exit_code, result.stdout) == (0, f"{out_dir}\n"), result.output
    assert (out_dir / ".complete").read_bytes() == b""
    check = check_snapshot(str(out_dir))
    assert (check.complete, check.detail) == (True, "complete: 1 shards, 460032 tensor bytes")
    code, out = cli("tiny-model", "--out", str(out_dir), "--arch", "gpt2")
    assert (code, out.strip()) == (2, "error: --arch must be llama, qwen2 or qwen3, got 'gpt2'")


def test_the_cli_tiny_model_holds_a_prompt_plus_the_suites_default_max_new_tokens(tmp_path: Path) -> None:
    """The README's one-at-a-time suite (default `max_new_tokens`) measures on `tiny-model`'s output:
    its context is 4096, so a prompt of up to 3072 tokens plus 1024 new ones fits (the engine refuses
    prompt + max_new_tokens > context with a 400)."""
    import json

    from pinned_eval.suite import SamplingFallbacks

    out_dir = tmp_path / "tiny"
    code, out = cli("tiny-model", "--out", str(out_dir))
    assert code == 0, out
    config = json.loads((out_dir / "config.json").read_text())
    assert config["max_position_embeddings"] == 4096
    assert SamplingFallbacks.model_fields["max_new_tokens"].default == 1024
    code, out = cli("tiny-model", "--out", str(tmp_path / "short"), "--context-length", "256")
    assert code == 0, out
    assert json.loads((tmp_path / "short" / "config.json").read_text())["max_position_embeddings"] == 256
