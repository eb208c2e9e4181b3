"""The watch evaluator's scan (real local filesystem) and per-tick decisions, without a server."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from flows.watch import Checkpoint, decide, scan, step_of


@pytest.mark.parametrize(
    ("name", "step"),
    [("step_120", 120), ("iter_0000120", 120), ("ckpt-120", 120), ("120", 120), ("global_step7", 7)],
)
def test_trailing_step(name: str, step: int):
    assert step_of(name) == step


@pytest.mark.parametrize("name", ["latest", "step_12.tmp", "ckpt-12-old", ""])
def test_names_without_a_trailing_step(name: str):
    assert step_of(name) is None


def make(root: Path, name: str, *, marker: bool, age_s: float = 0.0) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    if marker:
        (d / ".complete").write_text("{}")
    if age_s:
        t = time.time() - age_s
        for f in d.iterdir():
            os.utime(f, (t, t))
    return d


def test_scan_lists_step_dirs_lowest_first(tmp_path: Path):
    make(tmp_path, "ckpt-30", marker=True)
    make(tmp_path, "step_10", marker=True)
    make(tmp_path, "iter_0000020", marker=False)
    (tmp_path / "step_99").write_text("a file, not a checkpoint")
    (tmp_path / "latest").mkdir()
    found = scan(str(tmp_path))
    assert [(c.step, c.marked) for c in found] == [(10, True), (20, False), (30, True)]
    assert found[0].url.endswith("step_10")
    assert scan(str(tmp_path / "missing")) == []


def ck(step: int, marked: bool = True, mtime: float = 1000.0) -> Checkpoint:
    return Checkpoint(step=step, url=f"/c/step_{step}", marked=marked, newest_mtime=mtime)


def test_decide_all_skips_existing_unready_and_below_min():
    cks = [ck(5), ck(10), ck(20), ck(30, marked=False), ck(40)]
    got = decide(cks, {10}, catch_up="all", min_step=8, quiescence_seconds=None, now=2000.0)
    assert [(d.step, d.action) for d in got] == [
        (5, "below_min_step"),
        (10, "exists"),
        (20, "requested"),
        (30, "not_ready"),
        (40, "requested"),
    ]


def test_decide_latest_requests_only_the_newest_ready():
    cks = [ck(10), ck(20), ck(30, marked=False)]
    got = decide(cks, set(), catch_up="latest", min_step=0, quiescence_seconds=None, now=2000.0)
    assert [(d.step, d.action) for d in got] == [(10, "not_latest"), (20, "requested"), (30, "not_ready")]
    # the newest already has a point: nothing to do
    got = decide(cks, {20}, catch_up="latest", min_step=0, quiescence_seconds=None, now=2000.0)
    assert [d.action for d in got] == ["not_latest", "exists", "not_ready"]


def test_quiescence_makes_an_unmarked_checkpoint_ready_once_it_is_old_enough():
    cks = [ck(10, marked=False, mtime=1000.0)]
    assert decide(cks, set(), catch_up="all", min_step=0, quiescence_seconds=60, now=1030.0)[0].action == "not_ready"
    assert decide(cks, set(), catch_up="all", min_step=0, quiescence_seconds=60, now=1060.0)[0].action == "requested"
