"""The demo trainer: loss goes down, RL steps consume the fully-async producer's rollouts (in
lockstep: on-policy and reproducible), exports are complete HF snapshots that transformers loads
and decodes like the trainer, accuracy climbs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from app.demo import tasks
from app.demo.trainer import DemoConfig, DemoTrainer
from engine.tiny_model import make_tiny_model
from pinned_eval.snapshot.check import check_snapshot


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("demo-base") / "base", seed=0)


def _config(tmp_path, base_dir, **kw) -> DemoConfig:
    return DemoConfig(work_dir=tmp_path, base_model_dir=base_dir, **kw)


ADD = tasks.eval_sets()[0]  # arith_add


@dataclass(frozen=True)
class Warm:
    dir: Path  # the weights after the warm-up (a complete snapshot)
    before: float  # arith_add accuracy of the base model
    after: float  # ... after the warm-up


@pytest.fixture(scope="module")
def warm(tmp_path_factory, base_dir) -> Warm:
    """200 supervised warm-up steps (no producer involved), exported."""
    tmp = tmp_path_factory.mktemp("demo-warm")
    with DemoTrainer(_config(tmp, base_dir, warmup_steps=200)) as tr:
        before = tr.score(list(ADD.prompts), list(ADD.labels))
        tr.run(200)
        tr.export(tmp / "warm")
        return Warm(tmp / "warm", before, tr.score(list(ADD.prompts), list(ADD.labels)))


def test_tasks_match_the_eval_datasets():
    every = {f.prompt: f.label for f in tasks.all_facts()}
    for ds in tasks.eval_sets():
        assert len(ds.prompts) == 64
        for prompt, label in zip(ds.prompts, ds.labels, strict=True):
            assert every[prompt] == label  # same strings, same answers as the eval
    heldout = tasks.facts("heldout")
    assert len(heldout) == 200 - 128
    assert not {f.prompt for f in heldout} & tasks.eval_prompts()
    assert tasks.reward("7", "7") == 1.0 and tasks.reward("17", "7") == 0.0


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValidationError, match="n_samples_per_prompt"):
        DemoConfig(work_dir=tmp_path, objective="pg", n_samples_per_prompt=1)
    with pytest.raises(ValidationError, match="warmup_split"):
        DemoConfig(work_dir=tmp_path, warmup_split="test")


def test_warmup_loss_decreases(tmp_path, base_dir):
    with DemoTrainer(_config(tmp_path, base_dir, warmup_steps=40)) as tr:
        stats = tr.run(40)
    assert [s.step for s in stats] == list(range(1, 41))
    assert all(s.phase == "warmup" and s.weight_version == str(s.step) for s in stats)
    first = sum(s.loss for s in stats[:5]) / 5
    last = sum(s.loss for s in stats[-5:]) / 5
    assert last < 0.7 * first, (first, last)


def test_rl_steps_consume_producer_rollouts(tmp_path, base_dir):
    cfg = _config(
        tmp_path, base_dir, warmup_steps=2, rollout_batch_size=3, n_samples_per_prompt=4,
        max_weight_staleness=1,
    )
    assert cfg.lockstep is False  # the default, which the demo runs: fully async
    with DemoTrainer(cfg) as tr:
        stats = tr.run(6)
        generated = tr._worker.samples_generated
    rl = [s for s in stats if s.phase == "rl"]
    assert len(rl) == 4
    for s in rl:
        assert 0.0 <= s.reward_mean <= 1.0
        assert 0 <= s.staleness_mean <= 1  # the producer's staleness filter held
        assert s.rollout_metrics["rollout/fully_async/consumed_groups"] == 3.0
        # filtered SFT trains exactly on the reward-1 samples
        assert s.samples_used == round(s.reward_mean * 12)
    assert generated >= 4 * 3 * 4


def _trace(stats) -> list[tuple]:
    """Everything of a step that is not a wall time."""
    return [(s.step, s.phase, s.loss, s.reward_mean, s.samples_used, s.staleness_mean) for s in stats]


def test_lockstep_rl_is_on_policy_never_runs_ahead_and_repeats_itself(tmp_path, warm):
    def rl_run(seed: int) -> tuple[list[tuple], int]:
        cfg = _config(
            tmp_path, warm.dir, warmup_steps=2, rollout_batch_size=3, n_samples_per_prompt=4, lockstep=True,
            seed=seed,
        )
        with DemoTrainer(cfg) as tr:
            stats = tr.run(6)
            generated = tr._worker.samples_generated
        rl = stats[2:]
        assert [s.phase for s in stats] == ["warmup"] * 2 + ["rl"] * 4
        assert sum(s.samples_used for s in rl) > 0  # it trains: the comparisons below are not of zeros
        for s in rl:
            assert s.staleness_mean == 0.0  # each batch by the weights published just before it
            assert s.rollout_metrics["rollout/fully_async/consumed_groups"] == 3.0
            assert s.rollout_metrics["rollout/fully_async/stale_groups_filtered"] == 0.0
        return _trace(stats), generated

    trace, generated = rl_run(seed=0)
    assert generated == 4 * 3 * 4  # exactly the consumed batches: the next one waits for its step
    assert rl_run(seed=0) == (trace, generated)  # same seed: same losses and rewards, exactly
    assert rl_run(seed=1)[0] != trace  # the seed does reach the rollouts


def test_lockstep_needs_one_batch_in_flight():
    from app.demo.rollouts import CyclingSource, PromptItem, RolloutWorker
    from trainer_integration.producer import ProducerConfig

    producer = ProducerConfig(rollout_batch_size=2, n_samples_per_prompt=4, max_concurrent_samples=4)
    with pytest.raises(ValueError, match="max_concurrent_samples"):
        RolloutWorker(
            None, None, CyclingSource([PromptItem("1+1=", "2")], 4, seed=0), producer,
            reward=tasks.reward, temperature=1.0, max_new_tokens=4, seed=0, version=0, lockstep=True,
        )


def test_pg_objective_runs(tmp_path, base_dir):
    cfg = _config(tmp_path, base_dir, warmup_steps=0, objective="pg", rollout_batch_size=2, n_samples_per_prompt=4)
    with DemoTrainer(cfg) as tr:
        stats = tr.run(2)
    assert [s.phase for s in stats] == ["rl", "rl"]
    assert all(s.samples_used % 4 == 0 for s in stats)  # a group counts only when its rewards differ


def _hf_greedy(path, prompts: list[str]) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    enc = tok(prompts, return_tensors="pt", padding=True)
    nl = tok.encode("\n", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id,
            eos_token_id=[tok.eos_token_id, *nl],
        )
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return [t.split("\n", 1)[0] for t in texts]


def test_export_is_a_complete_snapshot_transformers_loads(tmp_path, base_dir):
    dest = tmp_path / "snap"
    prompts = list(tasks.eval_sets()[0].prompts[:24]) + list(tasks.eval_sets()[1].prompts[:24])
    with DemoTrainer(_config(tmp_path, base_dir, warmup_steps=30)) as tr:
        tr.run(30)
        first = tr.export(dest)
        assert first.weight_version == "30"
        assert check_snapshot(str(dest)).complete
        ours = tr.greedy(prompts)
        assert _hf_greedy(dest, prompts) == ours
        assert any(r.strip() for r in ours)
        state = {k: v.clone() for k, v in tr.model.state_dict().items()}
        tr.run(5)
        second = tr.export(dest)  # same place, a later version: stale files replaced
    assert second.weight_version == "35"
    assert check_snapshot(str(dest)).complete
    written = {}
    for shard in dest.glob("*.safetensors"):
        written.update(load_file(shard))
    base = {}
    for shard in base_dir.glob("*.safetensors"):
        base.update(load_file(shard))
    assert set(written) == set(base)  # same tensor names as make_tiny_model's output
    assert any(not torch.equal(written[k], state[k]) for k in written)  # the later weights
    assert (dest / "tokenizer.json").is_file() and (dest / "config.json").is_file()


@pytest.mark.slow
def test_accuracy_on_arith_add_improves(tmp_path, warm):
    """The warm-up (no producer) lifts arith_add from 0; then the RL phase, in lockstep so its
    rollouts do not depend on timing, gives the same trajectory on both runs from the same warm
    weights and seed (losses, rewards, weights, score: exactly), each batch by the previous
    step's weights, and keeps the gain."""
    prompts, labels = list(ADD.prompts), list(ADD.labels)
    runs = []
    for _ in range(2):
        cfg = _config(tmp_path, warm.dir, warmup_steps=0, rollout_batch_size=8, lockstep=True)
        with DemoTrainer(cfg) as tr:
            stats = tr.run(30)
            weights = {k: v.clone() for k, v in tr.model.state_dict().items()}
            runs.append((_trace(stats), tr.score(prompts, labels), weights, tr._worker.samples_generated))
            assert all(s.rollout_metrics["rollout/fully_async/stale_groups_filtered"] == 0.0 for s in stats)
    (trace, after, weights, generated), (trace2, after2, weights2, generated2) = runs
    assert trace == trace2 and after == after2  # same seed, same run: load and thread timing play no part
    assert weights.keys() == weights2.keys() and all(torch.equal(weights[k], weights2[k]) for k in weights)
    assert [t[0] for t in trace] == list(range(1, 31)) and {t[1] for t in trace} == {"rl"}
    assert {t[5] for t in trace} == {0.0}  # every batch generated by the weights of the step before
    assert generated == generated2 == 30 * 8 * 8  # generation never ran ahead of the trainer
    # an untrained model answers none; seed 0 gives 0.28 after the warm-up and 0.33 after the RL steps
    assert warm.before == 0.0 and warm.after >= 0.15, warm
    assert after >= warm.before + 0.15, (warm, after)
    assert sum(t[3] for t in trace[-10:]) / 10 > 0.1, trace[-10:]  # the RL phase earns reward


def test_two_phase_exporter_writes_the_weights_of_the_staging_moment(tmp_path, base_dir):
    import json

    from pinned_eval.snapshot.host_staging import HostStaging

    pool = HostStaging(pinned=False)
    assert pool.acquire(wait=False)
    with DemoTrainer(_config(tmp_path, base_dir, warmup_steps=30)) as tr:
        tr.run(3)
        state = {k: v.clone() for k, v in tr.model.state_dict().items()}
        staged = tr.exporter().stage(3, pool)
        tr.run(2)  # training goes on while the snapshot is written
        staged.write(str(tmp_path / "snap"))
    dest = tmp_path / "snap"
    assert check_snapshot(str(dest)).complete
    written = {k: v for shard in dest.glob("*.safetensors") for k, v in load_file(shard).items()}
    base = {k for shard in base_dir.glob("*.safetensors") for k in load_file(shard)}
    assert set(written) == base and all(torch.equal(written[k], state[k]) for k in written)
    assert json.loads((dest / ".complete").read_text())["metadata"] == {"weight_version": "3", "step": 3}
