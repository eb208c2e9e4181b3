"""Scoring keeps miles' rule for rewards a rollout set (generate_and_rm): a reward set during
generation is kept, the dataset's reward scores the others, ABORTED samples get none."""

from __future__ import annotations

from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults
from tasks.generate import Generation
from tasks.score import score_generations

SUITE = EvalSuite(
    datasets=(DatasetSpec(name="add", path="builtin:arith_add.jsonl", max_prompts=4),),
    defaults=SamplingDefaults(temperature=0.0, max_new_tokens=5, reward="exact_match"),
)


def _sample(i: int, response: str, *, reward: float | None = None, status: str | None = None) -> Generation:
    return Generation(
        dataset="add", prompt_index=i, sample_index=0, prompt=f"p{i}", label="7", metadata={},
        response=response, response_len=1, finish_reason="stop", weight_version="5",
        status=status, reward=reward,
    )


def test_a_preset_reward_is_kept_others_scored_aborted_unscored() -> None:
    gens = [
        _sample(0, "7"),  # scored by exact_match: 1.0
        _sample(1, "8"),  # scored: 0.0
        _sample(2, "8", reward=0.25, status="completed"),  # the function's reward wins over exact_match's 0.0
        _sample(3, "7", status="aborted"),  # never scored, even though the answer matches
    ]
    metrics, _, rewards = score_generations(gens, SUITE.resolved(), SUITE, step=5)
    assert rewards == {("add", 0, 0): 1.0, ("add", 1, 0): 0.0, ("add", 2, 0): 0.25, ("add", 3, 0): None}
    assert metrics["add"]["eval/add"] == (1.0 + 0.0 + 0.25 + 0.0) / 4
    assert metrics["add"]["eval/add-none_reward_ratio"] == 0.25


def test_single_turn_samples_are_all_scored_as_before() -> None:
    gens = [_sample(0, "7"), _sample(1, "7")]
    _, _, rewards = score_generations(gens, SUITE.resolved(), SUITE, step=5)
    assert rewards == {("add", 0, 0): 1.0, ("add", 1, 0): 1.0}
