"""The watch evaluator end to end: checkpoints appear in a trainer's directory one by one; ticks
of the `watch-checkpoints` flow request one point per ready step, run by the deployed worker on
the CPU fleet — once each across ticks and a restarted watcher (Prefect is the only ledger)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.watch import watch_checkpoints
from pinned_eval.sinks import JsonlSink
from tests.deploykit import Deployed, runs_of_deployment, wait_for
from tests.pointkit import PointEnv, write_step_snapshot

pytestmark = pytest.mark.e2e


def tick(env: PointEnv, root: Path) -> dict[int, str]:
    decisions = watch_checkpoints(run=env.run, root=str(root), **env.blocks)
    return {d.step: d.action for d in decisions}


def test_watch_requests_each_ready_checkpoint_once(point_env: PointEnv, deployed: Deployed, tiny_model: Path, tmp_path):
    root = tmp_path / "trainer-checkpoints"
    root.mkdir()
    write_step_snapshot(tiny_model, str(root / "step_10"), scale=0.001, seed=10)
    write_step_snapshot(tiny_model, str(root / "iter_0000020"), scale=0.002, seed=20)
    assert tick(point_env, root) == {10: "requested", 20: "requested"}

    write_step_snapshot(tiny_model, str(root / "ckpt-30"), scale=0.003, seed=30)
    write_step_snapshot(tiny_model, str(root / "step_40"), scale=0.004, seed=40)
    (root / "step_40" / ".complete").unlink()  # the trainer is still writing it
    write_step_snapshot(tiny_model, str(root / "step_50"), scale=0.005, seed=50)
    second = tick(point_env, root)
    assert second[40] == "not_ready"
    assert second[30] == second[50] == "requested"
    # 10 and 20 were requested by the first tick: their runs exist by now, or the resent
    # events carry the same ids — either way they stay one point each
    assert {second[10], second[20]} <= {"exists", "requested"}

    def all_done():  # type: ignore[no-untyped-def]
        runs = runs_of_deployment(deployed.deployment_id, point_env.run)
        return len(runs) == 4 and all(r.state.is_final() for r in runs) and runs

    runs = wait_for(all_done, 240, "four terminal points", interval_s=1)
    # a restarted watcher (a new flow run, nothing carried over) finds every point in Prefect
    assert tick(point_env, root) == {10: "exists", 20: "exists", 30: "exists", 40: "not_ready", 50: "exists"}
    runs = runs_of_deployment(deployed.deployment_id, point_env.run)
    assert sorted(r.parameters["step"] for r in runs) == [10, 20, 30, 50]
    assert all(r.state.name == "Completed" for r in runs), [(r.name, r.state.name, r.state.message) for r in runs]
    for r in runs:
        assert r.parameters["source"]["kind"] == "hf"
    assert all((root / n).exists() for n in ("step_10", "iter_0000020", "ckpt-30", "step_50"))  # never deleted
    measured = {row.step for row in JsonlSink(point_env.jsonl).read(point_env.run) if row.state == "measured"}
    assert measured == {10, 20, 30, 50}
