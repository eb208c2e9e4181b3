"""The demo's synthetic task: one-digit arithmetic facts in the eval datasets' exact format.

Contract:
- A `Fact` is a prompt `"a+b="` (a, b in 0..9) or `"a-b="` (b in 0..9, answer in 0..9, so a in
  0..18), with its label (the answer as a string). `all_facts()` is all 200 of them, in a fixed
  order. These are the same prompt and label strings as `pinned_eval/datasets/builtin/arith_add.jsonl`
  and `arith_sub.jsonl` (64 of the 100 facts of each op).
- `facts(split)`: `"all"` = every fact; `"heldout"` = the facts whose prompt is NOT in the eval
  datasets (36 + 36), so training on it never shows an eval prompt. Which split each training
  phase uses is the trainer's config; nothing here reads the eval files except `eval_prompts()`.
- A training string is `prompt + label + "\\n"`: the eval suite generates greedily with stop
  `"\\n"` and scores with `exact_match` (first token of the response == label).
- `reward(response, label)` is the eval's own `exact_match`, so the training reward and the eval
  metric agree by construction.
No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Literal

from pinned_eval.scoring.rewards import exact_match

Split = Literal["all", "heldout"]
EVAL_DATASETS = ("arith_add", "arith_sub")
STOP = "\n"


@dataclass(frozen=True, slots=True)
class Fact:
    prompt: str
    label: str

    @property
    def text(self) -> str:
        """The supervised training string."""
        return self.prompt + self.label + STOP


def all_facts() -> list[Fact]:
    add = [Fact(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    sub = [Fact(f"{b + c}-{b}=", str(c)) for b in range(10) for c in range(10)]
    return add + sub


@dataclass(frozen=True, slots=True)
class EvalSet:
    name: str
    prompts: tuple[str, ...]
    labels: tuple[str, ...]


@lru_cache(maxsize=1)
def eval_sets() -> tuple[EvalSet, ...]:
    """The builtin eval datasets the demo is measured on (read from the package data)."""
    out = []
    for name in EVAL_DATASETS:
        text = resources.files("pinned_eval.datasets").joinpath("builtin", f"{name}.jsonl").read_text()
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        out.append(EvalSet(name, tuple(r["prompt"] for r in rows), tuple(str(r["label"]) for r in rows)))
    return tuple(out)


def eval_prompts() -> frozenset[str]:
    return frozenset(p for s in eval_sets() for p in s.prompts)


def facts(split: Split) -> list[Fact]:
    if split == "all":
        return all_facts()
    if split == "heldout":
        held = eval_prompts()
        return [f for f in all_facts() if f.prompt not in held]
    raise ValueError(f"split: unknown split {split!r}; expected 'all' or 'heldout'")


def reward(response: str, label: str) -> float:
    return exact_match(response, label)
