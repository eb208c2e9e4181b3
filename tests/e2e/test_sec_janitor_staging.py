"""The janitor on a shared node: a staging root a neighbour redirected is never swept.

A neighbour (`pe-neighbour`) plants a symlink where the saved staging block's root lies (under
`shared_dir`, world-writable with the sticky bit, like /tmp), pointing at the owner's real
checkpoints, laid out as an orphaned staging run would be. Before the fix the janitor followed
it and deleted them (keep_snapshots=0, no point of that run exists, orphan age 0).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from blocks import StagingBlock
from tests.neighbour import Neighbour, run_as

pytestmark = pytest.mark.e2e


def test_janitor_refuses_a_root_symlinked_to_the_owners_checkpoints(
    prefect_server: str, neighbour: Neighbour, shared_dir: Path, tmp_path: Path
) -> None:
    from flows.janitor import janitor

    run = f"r{uuid.uuid4().hex[:8]}"
    ckpts = tmp_path / "checkpoints"
    step = ckpts / run / "step_00000001"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"precious weights")
    (step / ".complete").write_text("")
    before = sorted(str(p.relative_to(ckpts)) for p in ckpts.rglob("*"))
    root = shared_dir / "staging"
    planted = run_as(neighbour, "import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(ckpts), str(root))
    assert planted.returncode == 0, planted.stderr
    name = f"sec-{uuid.uuid4().hex[:6]}"
    StagingBlock(root=str(root), keep_snapshots=0).save(name)

    report = janitor(heartbeat_window_s=600, run=run, orphan_age_s=0, staging=[name])

    assert sorted(str(p.relative_to(ckpts)) for p in ckpts.rglob("*")) == before
    assert report.retired == [] and report.kept_live == []
    assert report.refused == [f"{name}: staging root {str(root)!r} refused: it is a symlink (to {str(ckpts)!r})"]
