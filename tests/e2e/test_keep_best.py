"""Best-K retention through the real eval-point flow: the flow ranks the run's measured steps from
its JSONL sink and its retire keeps the best step's snapshot beside the keep-ring."""

from __future__ import annotations

from pathlib import Path

import pytest

from blocks import SinksBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.sinks import JsonlSink
from tests.pointkit import PointEnv, write_step_snapshot

pytestmark = pytest.mark.e2e

METRIC = "eval/arith_add"


def test_best_step_survives_beside_a_ring_of_one(point_env: PointEnv, tiny_model: Path) -> None:
    block = StagingBlock.load(point_env.blocks["staging"])
    block.keep_snapshots, block.keep_best, block.keep_best_metric = 1, 1, METRIC
    block.save(point_env.blocks["staging"], overwrite=True)
    store = block.staging()
    paths = {}
    for step in (1, 2, 3):
        paths[step] = write_step_snapshot(tiny_model, store.path_for(point_env.run, step))
        state = eval_point(**point_env.params(step, source={"kind": "staged", "path": paths[step]}), return_state=True)
        assert state.name == "Completed", state.message
    scores = {r.step: r.metrics[METRIC] for r in JsonlSink(point_env.jsonl).read(point_env.run) if METRIC in r.metrics}
    assert len(scores) == 3 and len(set(scores.values())) == 1, f"same weights, same score: {scores}"
    # a tie goes to the earliest step: best {1}, ring {3}; step 2 left both
    assert {s for s, p in paths.items() if Path(p).exists()} == {1, 3}


def test_keep_best_without_a_jsonl_file_fails_the_point_and_deletes_nothing(
    point_env: PointEnv, tiny_model: Path
) -> None:
    block = StagingBlock.load(point_env.blocks["staging"])
    block.keep_snapshots, block.keep_best, block.keep_best_metric = 0, 1, METRIC
    block.save(point_env.blocks["staging"], overwrite=True)
    SinksBlock().save(point_env.blocks["sinks"], overwrite=True)  # no jsonl_path to rank from
    dest = write_step_snapshot(tiny_model, block.staging().path_for(point_env.run, 1))
    state = eval_point(**point_env.params(1, source={"kind": "staged", "path": dest}), return_state=True)
    assert state.is_failed() and "keep_best: ranks steps from the sinks block's jsonl_path" in str(state.message)
    assert Path(dest).exists(), "keep_snapshots=0, yet nothing is deleted"
