"""W&B writers without a W&B server: the dedicated eval run (offline files, parsed) and the shared
writer's settings (shared mode needs W&B online, so only its settings are checked here)."""

from __future__ import annotations

from pathlib import Path

from pinned_eval.sinks import log_to_wandb, shared_writer_settings, wandb_eval_run_id
from tests.wandb_offline import history_rows, metric_definitions, runs


def test_eval_run_is_grouped_with_the_training_run_and_keyed_on_eval_step(tmp_path: Path) -> None:
    for step, value in ((100, 0.5), (200, 0.75)):
        log_to_wandb({"eval/step": step, "eval/gsm8k": value}, project="p", run_id="train-7", entity=None,
                     mode="offline", directory=str(tmp_path))
    assert runs(tmp_path) == [{"id": "train-7-eval", "group": "train-7", "job_type": "eval"}] * 2
    assert wandb_eval_run_id("train-7") == "train-7-eval"
    assert {("eval/step", ""), ("eval/*", "eval/step")} <= metric_definitions(tmp_path)
    assert history_rows(tmp_path) == [{"eval/step": 100, "eval/gsm8k": 0.5}, {"eval/step": 200, "eval/gsm8k": 0.75}]


def test_shared_writer_is_a_labelled_secondary_that_leaves_the_run_running() -> None:
    s = shared_writer_settings("pe-exp-step-7")
    assert (s.mode, s.x_label, s.x_primary, s.x_update_finish_state) == ("shared", "pe-exp-step-7", False, False)
    assert s._shared and not s._offline
