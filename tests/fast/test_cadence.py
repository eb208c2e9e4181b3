"""Per-dataset cadence (pinned_eval.suite): every_n_steps, num_examples, the final point runs all."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults

SUITE = EvalSuite(
    datasets=(
        DatasetSpec(name="cheap", path="builtin:arith_add.jsonl"),
        DatasetSpec(name="mid", path="builtin:arith_sub.jsonl", every_n_steps=200),
        DatasetSpec(name="rare", path="builtin:arith_add.jsonl", every_n_steps=500, num_examples=3),
    )
)


def _names(step: int, final: bool = False) -> list[str] | None:
    due = SUITE.due_at(step, final=final)
    return None if due is None else [d.name for d in due.datasets]


def test_due_datasets_by_step() -> None:
    assert _names(100) == ["cheap"]
    assert _names(200) == ["cheap", "mid"]
    assert _names(1000) == ["cheap", "mid", "rare"]
    assert _names(0) == ["cheap", "mid", "rare"]
    assert _names(101, final=True) == ["cheap", "mid", "rare"]


def test_no_dataset_due_is_none() -> None:
    suite = EvalSuite(datasets=(DatasetSpec(name="rare", path="x.jsonl", every_n_steps=500),))
    assert suite.due_at(100) is None
    assert [d.name for d in suite.due_at(100, final=True).datasets] == ["rare"]  # type: ignore[union-attr]


def test_num_examples_is_max_prompts_and_cadence_resolves() -> None:
    rare = SUITE.resolved()[2]
    assert (rare.max_prompts, rare.every_n_steps) == (3, 500)
    assert SUITE.resolved()[0].every_n_steps is None
    assert SamplingDefaults(num_examples=7).max_prompts == 7
    with pytest.raises(ValidationError, match="num_examples: another name of max_prompts"):
        DatasetSpec(name="x", path="x", num_examples=3, max_prompts=4)
    with pytest.raises(ValidationError, match="every_n_steps"):
        DatasetSpec(name="x", path="x", every_n_steps=0)


def test_miles_yaml_accepts_the_cadence_keys() -> None:
    text = (
        "eval:\n  defaults: {rm_type: math}\n  datasets:\n"
        "    - {name: a, path: builtin:arith_add.jsonl, every_n_steps: 50, num_examples: 2}\n"
    )
    suite = EvalSuite.from_miles_yaml(text)
    assert (suite.datasets[0].every_n_steps, suite.datasets[0].max_prompts) == (50, 2)
    with pytest.raises(ValueError, match=r"every_n_steps: a pinned-eval extension"):
        EvalSuite.from_miles_yaml(text, strict_miles=True)
