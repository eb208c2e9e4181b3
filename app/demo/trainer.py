"""`DemoTrainer`: a tiny fully-async RL job on CPU whose arithmetic eval score climbs.

What it trains (see `tasks.py` for the data):
1. `warmup_steps` supervised steps on `"a+b=c\\n"` / `"a-b=c\\n"` strings of `warmup_split`
   (default `"heldout"`: the 72 facts whose prompts are NOT in the eval datasets);
2. then RL steps on prompts of `rl_split` (default `"all"`, which includes the eval prompts; their
   labels reach the model only through the exact-match reward). Each RL step drains
   `rollout_batch_size` groups of `n_samples_per_prompt` samples from the reference
   `FullyAsyncProducer` (see `rollouts.py`), which keeps generating with a policy copy that lags
   the trainer by up to `max_weight_staleness` versions. Objective `"pg"`: group-relative policy
   gradient, advantage = reward - group mean (no std scaling, no importance ratio, no KL);
   `"filtered_sft"`: supervised loss on the reward-1 samples only (rejection-sampling fine-tuning).

Invariants:
- weight version = number of optimizer steps taken (`str(version)` is the engine's weight_version).
- After every step the policy copy gets the new weights and the producer the new version.
- `export(dest)` writes exactly the base snapshot's tensor names (same architecture and layout as
  `engine.tiny_model.make_tiny_model`) with `write_snapshot`, copying config/tokenizer from the
  base dir, so the CPU engine and transformers load it; `.complete` is written last.
  `exporter()` is the same export in two phases (staged at dispatch, written in the background).
- `score()` / `greedy()` decode in process with the same left-padded greedy decoder the rollouts
  use.
- Reproducibility: the warm-up is a function of the config and base weights; the default RL
  phase is not (which version generated which group depends on thread timing). `lockstep=True`
  (for tests) makes all of it one: the same producer and worker, but each RL step's batch is
  sampled only when the step asks for it, by the weights of the previous step (staleness 0,
  on-policy), so the same config (seed included) gives the same losses, rewards and weights on
  every run at any machine load (bit for bit on the same machine and torch build). The demo itself
  runs fully async (`lockstep=False`, the default).
No Prefect import.
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path
from typing import Literal, cast

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors import safe_open

from app.demo import tasks
from app.demo.rollouts import CyclingSource, PromptItem, RolloutWorker, sample
from engine.weights import weight_files
from pinned_eval.snapshot.two_phase import StateDictExport
from pinned_eval.snapshot.writer import write_snapshot
from trainer_integration.producer import ProducerConfig
from trainer_integration.rollout_buffer import Sample, iter_samples


class DemoConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    work_dir: Path = Field(description="Where the base model is made (when base_model_dir is None).")
    base_model_dir: Path | None = Field(
        default=None, description="An existing make_tiny_model snapshot to start from; None makes one."
    )
    hidden_size: int = Field(default=64, ge=8, description="Base model width (when made here).")
    num_layers: int = Field(default=2, ge=1, description="Base model depth (when made here).")
    seed: int = Field(default=0, description="Seeds the base model, the warm-up order and sampling.")
    threads: int = Field(default=1, ge=1, description="torch.set_num_threads for this process.")
    lr: float = Field(default=3e-3, gt=0, description="AdamW learning rate of the warm-up.")
    rl_lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate of the RL phase.")
    weight_decay: float = Field(default=0.01, ge=0)
    warmup_steps: int = Field(default=300, ge=0, description="Supervised steps before RL.")
    warmup_batch_size: int = Field(default=32, ge=1, description="Training strings per warm-up step.")
    warmup_split: tasks.Split = Field(default="heldout", description="Facts the warm-up sees.")
    rl_split: tasks.Split = Field(default="all", description="Prompts the RL phase samples.")
    objective: Literal["pg", "filtered_sft"] = Field(default="filtered_sft", description="RL loss.")
    scale_advantages: bool = Field(default=True, description="'pg': divide by the group's reward std.")
    rollout_batch_size: int = Field(default=16, ge=1, description="Prompt groups per RL step.")
    n_samples_per_prompt: int = Field(default=8, ge=1, description="Samples per prompt group.")
    temperature: float = Field(default=1.5, gt=0, description="Rollout sampling temperature.")
    max_new_tokens: int = Field(default=4, ge=1, description="Rollout length cap (the eval uses 4).")
    max_weight_staleness: int | None = Field(
        default=2, ge=0, description="Producer drops groups older than this many versions."
    )
    batch_timeout_s: float = Field(default=120.0, gt=0, description="Max wait for one rollout batch.")
    lockstep: bool = Field(
        default=False,
        description="Deterministic RL (tests): each step's batch is generated after the previous step's "
        "weights are published, by those weights; generation and training alternate.",
    )

    @model_validator(mode="after")
    def _check(self) -> DemoConfig:
        if self.objective == "pg" and self.n_samples_per_prompt < 2:
            raise ValueError("n_samples_per_prompt: the 'pg' objective needs >= 2 samples per group")
        return self


class StepStats(BaseModel):
    step: int = Field(description="The weight version after this step (1-based).")
    phase: Literal["warmup", "rl"]
    loss: float
    reward_mean: float | None = Field(description="Mean reward of the consumed rollouts (RL only).")
    samples_used: int = Field(description="Sequences with non-zero weight in the loss.")
    weight_version: str
    staleness_mean: float | None = Field(description="Mean (version - sample's version) (RL only).")
    seconds: float
    rollout_metrics: dict[str, float] = Field(default_factory=dict)


class ExportStats(BaseModel):
    path: str
    weight_version: str
    bytes: int
    seconds: float


class DemoTrainer:
    def __init__(self, config: DemoConfig) -> None:
        from transformers import (  # transformers: slow import, only when a model is loaded
            AutoModelForCausalLM,
            AutoTokenizer,
        )

        self.config = config
        torch.set_num_threads(config.threads)
        self.base_dir = config.base_model_dir or self._make_base()
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
        self.model.train()
        self._names = _weight_names(self.base_dir)
        missing = sorted(set(self._names) - set(self.model.state_dict()))
        if missing:
            raise ValueError(f"base_model_dir: tensors {missing[:3]} are not in the loaded model")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.version = 0
        self._rng = random.Random(config.seed)
        self._warm_facts = tasks.facts(config.warmup_split)
        self._rl_items = [PromptItem(f.prompt, f.label) for f in tasks.facts(config.rl_split)]
        self._worker: RolloutWorker | None = None

    def _make_base(self) -> Path:
        from engine.tiny_model import make_tiny_model  # transformers: slow import, only when a model is made

        c = self.config
        out = c.work_dir / "base"
        if not (out / "config.json").is_file():
            make_tiny_model(out, seed=c.seed, hidden_size=c.hidden_size, num_layers=c.num_layers)
        return out

    # ---- training ----------------------------------------------------------------------------

    @property
    def phase(self) -> Literal["warmup", "rl"]:
        return "warmup" if self.version < self.config.warmup_steps else "rl"

    def train_step(self) -> StepStats:
        t0 = time.perf_counter()
        if self.phase == "warmup":
            batch = [self._rng.choice(self._warm_facts) for _ in range(self.config.warmup_batch_size)]
            facts = [(self._prompt_ids(f.prompt), self._answer_ids(f)) for f in batch]
            loss = self._optimize(facts, [1.0] * len(facts), normalize=len(facts))
            return self._finish(t0, "warmup", loss, None, len(facts), None, {})
        for param_group in self.opt.param_groups:
            param_group["lr"] = self.config.rl_lr
        rollouts = self._rollout_worker().get_batch(timeout=self.config.batch_timeout_s)
        seqs: list[tuple[list[int], list[int]]] = []
        weights: list[float] = []
        rewards: list[float] = []
        versions: list[int] = []
        for group in rollouts.groups:
            samples = [cast(Sample, s) for s in iter_samples(group)]  # the demo producer makes Samples
            r = [float(s.reward or 0.0) for s in samples]
            mean = sum(r) / len(r)
            std = (sum((x - mean) ** 2 for x in r) / len(r)) ** 0.5
            scale = 1.0 / (std + 1e-6) if self.config.scale_advantages else 1.0
            for s, ri in zip(samples, r, strict=True):
                w = (ri - mean) * scale if self.config.objective == "pg" else ri
                seqs.append((self._prompt_ids(s.prompt), list(s.metadata["response_ids"])))
                weights.append(w)
                rewards.append(ri)
                assert s.weight_version is not None, "a generated sample carries its weight version"
                versions.append(s.weight_version)
        used = sum(1 for w in weights if w != 0)
        norm = len(seqs) if self.config.objective == "pg" else max(used, 1)
        loss = self._optimize(seqs, weights, normalize=norm) if used else 0.0
        staleness = sum(self.version - v for v in versions) / len(versions)
        return self._finish(
            t0, "rl", loss, sum(rewards) / len(rewards), used, staleness, rollouts.metrics
        )

    def _finish(self, t0, phase, loss, reward_mean, used, staleness, metrics) -> StepStats:
        self.version += 1
        if self._worker is not None:
            self._worker.publish(copy.deepcopy(self.model.state_dict()), self.version)
        return StepStats(
            step=self.version, phase=phase, loss=loss, reward_mean=reward_mean, samples_used=used,
            weight_version=str(self.version), staleness_mean=staleness,
            seconds=time.perf_counter() - t0, rollout_metrics=metrics,
        )

    def _optimize(self, seqs: list[tuple[list[int], list[int]]], weights: list[float], normalize: int) -> float:
        """One AdamW step on sum_i w_i * mean-token-NLL(response_i) / normalize."""
        width = max(len(p) + len(r) for p, r in seqs)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        target = torch.zeros((len(seqs), width), dtype=torch.bool)
        for i, (p, r) in enumerate(seqs):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            mask[i, : len(p) + len(r)] = 1
            target[i, len(p) : len(p) + len(r)] = True
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), ids[:, 1:], reduction="none"
        ) * target[:, 1:]
        per_seq = nll.sum(1) / target[:, 1:].sum(1).clamp(min=1)
        loss = (torch.tensor(weights) * per_seq).sum() / normalize
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def _prompt_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))  # BOS + prompt, as the engine encodes it

    def _answer_ids(self, fact: tasks.Fact) -> list[int]:
        return list(self.tokenizer.encode(fact.label + tasks.STOP, add_special_tokens=False))

    def _rollout_worker(self) -> RolloutWorker:
        if self._worker is None:
            c = self.config
            policy = copy.deepcopy(self.model).eval()
            for p in policy.parameters():
                p.requires_grad_(False)
            self._worker = RolloutWorker(
                policy, self.tokenizer,
                CyclingSource(self._rl_items, c.n_samples_per_prompt, seed=c.seed),
                ProducerConfig(
                    rollout_batch_size=c.rollout_batch_size, n_samples_per_prompt=c.n_samples_per_prompt,
                    max_weight_staleness=c.max_weight_staleness, submission_granularity="group",
                ),
                reward=tasks.reward, temperature=c.temperature, max_new_tokens=c.max_new_tokens,
                seed=c.seed + 1, version=self.version, lockstep=c.lockstep,
            )
        return self._worker

    def run(self, steps: int, on_step=None) -> list[StepStats]:
        """Convenience loop: `steps` train steps, calling `on_step(stats)` after each."""
        out = []
        for _ in range(steps):
            stats = self.train_step()
            out.append(stats)
            if on_step is not None:
                on_step(stats)
        return out

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __enter__(self) -> DemoTrainer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ---- evaluation and export ---------------------------------------------------------------

    @torch.no_grad()
    def greedy(self, prompts: list[str], max_new_tokens: int = 4) -> list[str]:
        """Greedy responses of the current weights (trimmed at "\\n"), as the eval suite asks."""
        self.model.eval()
        try:
            gens = sample(self.model, self.tokenizer, prompts, temperature=0.0, max_new_tokens=max_new_tokens)
        finally:
            self.model.train()
        return [g.text for g in gens]

    def score(self, prompts: list[str], labels: list[str]) -> float:
        if len(prompts) != len(labels) or not prompts:
            raise ValueError(f"labels: need one label per prompt, got {len(labels)} for {len(prompts)}")
        responses = self.greedy(prompts)
        return sum(tasks.reward(r, lab) for r, lab in zip(responses, labels, strict=True)) / len(prompts)

    def evaluate(self) -> dict[str, float]:
        """Greedy exact-match accuracy on each builtin eval dataset of the demo."""
        return {s.name: self.score(list(s.prompts), list(s.labels)) for s in tasks.eval_sets()}

    def exporter(self) -> StateDictExport:
        """The two-phase in-loop exporter of the current weights (`EvalClient.dispatch(step,
        export=trainer.exporter())`): the base snapshot's tensor names, staged into the client's
        host buffer at dispatch, written in the background with this version in the manifest."""

        def tensors() -> list[tuple[str, torch.Tensor]]:
            state = self.model.state_dict()
            return [(name, state[name]) for name in self._names]

        return StateDictExport(tensors, str(self.base_dir), metadata={"weight_version": str(self.version)})

    def export(self, dest: str | Path) -> ExportStats:
        state = self.model.state_dict()
        tensors = ((name, state[name].detach().clone()) for name in self._names)
        res = write_snapshot(
            list(tensors), str(dest), base_hf_dir=str(self.base_dir),
            metadata={"weight_version": str(self.version)},
        )
        return ExportStats(path=res.path, weight_version=str(self.version), bytes=res.bytes, seconds=res.seconds)


def _weight_names(hf_dir: Path) -> list[str]:
    names: list[str] = []
    for f in sorted(weight_files(Path(hf_dir))):
        with safe_open(f, framework="pt") as fh:
            names.extend(fh.keys())
    if not names:
        raise ValueError(f"base_model_dir: no weights found in {hf_dir}")
    return sorted(names)
