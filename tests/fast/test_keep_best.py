"""Best-K retention beside the keep-ring: the staging block's `keep_best`, `keep_best_metric` and
`keep_best_mode`, the steps ranked from the JSONL sink's measured rows (`StagingBlock.protected_steps`,
`pinned_eval.snapshot.keep_best.best_steps`) and kept by `Staging.retire(..., protect=...)`."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from blocks import StagingBlock
from pinned_eval.sinks import JsonlSink, MetricRow
from pinned_eval.snapshot.keep_best import best_steps

METRIC = "eval/arith_add"
SCORES = {1: 0.2, 2: 0.9, 3: 0.5, 4: 0.8, 5: 0.1, 6: 0.3}


def _measured(step: int, score: float, run: str = "exp1") -> MetricRow:
    return MetricRow(run=run, step=step, dataset="arith_add", state="measured", weight_version=str(step),
                     metrics={METRIC: score, "eval/step": float(step)})


def _snapshot(root: Path, step: int) -> None:
    d = root / "exp1" / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"w")
    (d / ".complete").write_text("")


def _on_disk(root: Path) -> set[int]:
    return {int(p.name.removeprefix("step_")) for p in (root / "exp1").iterdir()}


def _point(block: StagingBlock, sink: JsonlSink, root: Path, step: int, row: MetricRow | None) -> None:
    """One point as the flow runs it: snapshot, its row logged, then retired with the best steps."""
    staging = block.staging()
    if not (root / "exp1" / f"step_{step:08d}").exists():
        _snapshot(root, step)
    if row is not None:
        sink.write_point([row])
    staging.retire(staging.path_for("exp1", step), owned=True, protect=block.protected_steps("exp1", str(sink.path)))


@pytest.fixture
def env(tmp_path: Path) -> tuple[Path, JsonlSink]:
    root = tmp_path / "staging"
    root.mkdir(mode=0o700)
    return root, JsonlSink(tmp_path / "metrics.jsonl")


def test_best_two_and_the_newest_survive_each_retire(env: tuple[Path, JsonlSink]) -> None:
    root, sink = env
    block = StagingBlock(root=str(root), keep_snapshots=1, keep_best=2, keep_best_metric=METRIC)
    expected = {1: {1}, 2: {1, 2}, 3: {2, 3}, 4: {2, 4}, 5: {2, 4, 5}, 6: {2, 4, 6}}
    for step, score in SCORES.items():
        _point(block, sink, root, step, _measured(step, score))
        assert _on_disk(root) == expected[step], f"after step {step}"


def test_min_mode_keeps_the_lowest(env: tuple[Path, JsonlSink]) -> None:
    root, sink = env
    block = StagingBlock(root=str(root), keep_snapshots=1, keep_best=2, keep_best_metric=METRIC, keep_best_mode="min")
    for step, score in SCORES.items():
        _point(block, sink, root, step, _measured(step, score))
    assert _on_disk(root) == {1, 5, 6}


def test_keep_snapshots_zero_keeps_only_the_best(env: tuple[Path, JsonlSink]) -> None:
    root, sink = env
    block = StagingBlock(root=str(root), keep_snapshots=0, keep_best=1, keep_best_metric=METRIC)
    for step, score in SCORES.items():
        _point(block, sink, root, step, _measured(step, score))
    assert _on_disk(root) == {2}


def test_a_running_point_is_never_deleted_and_a_skipped_rerun_leaves_the_best(env: tuple[Path, JsonlSink]) -> None:
    root, sink = env
    block = StagingBlock(root=str(root), keep_snapshots=1, keep_best=2, keep_best_metric=METRIC)
    for step, score in SCORES.items():
        _point(block, sink, root, step, _measured(step, score))
    _snapshot(root, 8)  # point 8 still running: not retired
    sink.write_point([MetricRow(run="exp1", step=2, state="skipped", reason="busy")])  # step 2's rerun
    _point(block, sink, root, 7, _measured(7, 0.0))
    # best now {4, 3} (3 deleted long ago); newest 7; 8 still running; 2 and 6 leave
    assert _on_disk(root) == {4, 7, 8}


def test_other_runs_and_unmeasured_rows_do_not_rank() -> None:
    rows = [
        _measured(1, 0.5), _measured(2, 0.5), _measured(3, 0.4), _measured(4, 0.99, run="other"),
        MetricRow(run="exp1", step=5, state="failed", reason="crashed", metrics={METRIC: 1.0}),
        MetricRow(run="exp1", step=6, dataset="other_ds", state="measured", metrics={"eval/other_ds": 1.0}),
    ]
    assert best_steps(rows, "exp1", METRIC, 2) == frozenset({1, 2}), "ties go to the earliest step"
    assert best_steps(rows, "exp1", METRIC, 1) == frozenset({1})
    assert best_steps(rows, "exp1", METRIC, 1, "min") == frozenset({3})


def test_without_protect_a_keep_best_staging_deletes_nothing(env: tuple[Path, JsonlSink]) -> None:
    root, _ = env
    staging = StagingBlock(root=str(root), keep_snapshots=1, keep_best=2, keep_best_metric=METRIC).staging()
    for step in (1, 2, 3):
        _snapshot(root, step)
        assert staging.retire(staging.path_for("exp1", step), owned=True).deleted == []
    assert _on_disk(root) == {1, 2, 3}


def test_keep_best_needs_a_metric_and_a_jsonl_file(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="keep_best_metric: required when keep_best > 0"):
        StagingBlock(root=str(tmp_path), keep_best=2)
    with pytest.raises(ValidationError, match="keep_best"):
        StagingBlock(root=str(tmp_path), keep_best=-1, keep_best_metric=METRIC)
    block = StagingBlock(root=str(tmp_path), keep_best=2, keep_best_metric=METRIC)
    with pytest.raises(ValueError, match="keep_best: ranks steps from the sinks block's jsonl_path"):
        block.protected_steps("exp1", None)
    assert StagingBlock(root=str(tmp_path)).protected_steps("exp1", None) is None, "off: no ranking, no file"
