"""miles' offline rm types (deepscaler, dapo, gpqa) and rewards that read the row's metadata."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pinned_eval.scoring.answers import RewardRefused
from pinned_eval.scoring.choice_rewards import gpqa
from pinned_eval.scoring.math_rewards import deepscaler
from pinned_eval.scoring.miles_rewards import dapo
from pinned_eval.scoring.rewards import REWARD_NAMES, check_reward_name, get_reward


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("<think>maybe \\boxed{4}</think> so \\boxed{5}", "5", 1.0),  # only after </think> counts
        ("<think>\\boxed{5}</think> the answer is \\boxed{4}", "5", 0.0),
        ("\\boxed{5}", "5", 0.0),  # no </think> and no ###Response: 0
        ("prompt ###Response \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("<think>x</think> no box", "5", 0.0),
    ],
)
def test_deepscaler(response: str, label: str, expected: float) -> None:
    assert deepscaler(response, label) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("work...\nAnswer: 42", "42", 1.0),
        ("Answer: 41\nwait, Answer: $7$", "7", 1.0),  # the last Answer: line wins
        ("Answer: 0", "0.5", 1.0),  # miles reads the label as int(float(label))
        ("Answer: 0.0", "0", -1.0),
        ("Answer: 42\nactually Answer: 7", "42", -1.0),
        ("the result is 42", "42", -1.0),  # no Answer: line
        ("Answer: 42" + " filler" * 60, "42", -1.0),  # outside the last 300 characters
        ("answer : 1,000", "1000", 1.0),
    ],
)
def test_dapo_scores_plus_minus_one(response: str, label: str, expected: float) -> None:
    assert dapo(response, label) == expected


@pytest.mark.parametrize(
    ("response", "label", "metadata", "expected"),
    [
        ("The answer is (B).", "B", {}, 1.0),
        ("Answer: c", "C", {}, 1.0),
        ("so \\boxed{D}", "D", {}, 1.0),
        ("Answer: Because it is A", "B", {}, 1.0),  # miles reads the B of "Because"
        ("Option A is wrong. Answer: B", "B", {}, 0.0),  # `option X` is tried first
        ("B", "B", {}, 1.0),
        ("The answer is (E)", "A", {}, 0.0),  # E is not among A-D
        ("The answer is (E)", "E", {"choices": ["1", "2", "3", "4", "5"]}, 1.0),
        ("Answer: B", "photosynthesis", {"choices": ["respiration", "photosynthesis"]}, 1.0),
        ("Answer: A", "photosynthesis", {"choices": ["respiration", "photosynthesis"]}, 0.0),
        ("Answer: C", "ignored text", {"correct_letter": "C"}, 1.0),
        ("Answer: F", "F", {"valid_letters": "ABCDEF"}, 1.0),
    ],
)
def test_gpqa_reads_choices_from_metadata(response: str, label: str, metadata: dict, expected: float) -> None:
    assert gpqa(response, label, metadata) == expected


def test_gpqa_without_a_correct_letter_falls_back_to_the_label_text() -> None:
    assert gpqa("It is photosynthesis.", "photosynthesis", {}) == 1.0
    assert gpqa("It is respiration.", "photosynthesis", {}) == 0.0


def test_dapo_refuses_a_label_that_is_not_a_number() -> None:
    with pytest.raises(RewardRefused, match="dapo: label 'five' is not a number"):
        dapo("Answer: 5", "five")


@given(st.sampled_from("ABCD"), st.sampled_from("ABCD"))
def test_gpqa_is_one_iff_the_stated_letter_is_correct(stated: str, correct: str) -> None:
    assert gpqa(f"Reasoning first.\nThe answer is ({stated})", correct) == float(stated == correct)


def test_registry_knows_the_miles_types_and_refuses_remote_in_process() -> None:
    assert {"deepscaler", "dapo", "gpqa", "remote_rm"} <= set(REWARD_NAMES)
    for name in ("deepscaler", "dapo", "gpqa", "remote_rm"):
        assert check_reward_name(name) == name
    assert get_reward("gpqa") is gpqa
    with pytest.raises(ValueError, match=r"remote_rm.*score_responses"):
        get_reward("remote_rm")


@pytest.fixture
def metadata_rewards() -> Iterator[str]:
    mod = types.ModuleType("pe_test_metadata_rewards")

    def by_difficulty(response: str, label: str, metadata: dict) -> float:
        return float(response == label) * metadata["weight"]

    def two_args(response: str, label: str) -> float:
        return float(response == label)

    mod.by_difficulty = by_difficulty  # type: ignore[attr-defined]
    mod.two_args = two_args  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        yield mod.__name__
    finally:
        del sys.modules[mod.__name__]
        get_reward.cache_clear()


def test_custom_reward_with_a_metadata_parameter_gets_the_rows_metadata(metadata_rewards: str) -> None:
    fn = get_reward(f"custom:{metadata_rewards}:by_difficulty")
    assert fn("7", "7", {"weight": 0.5}) == 0.5
    assert fn("6", "7", {"weight": 0.5}) == 0.0
    with pytest.raises(KeyError, match="weight"):  # its own errors propagate (a crashed point)
        fn("7", "7", {})
    assert get_reward(f"custom:{metadata_rewards}:two_args")("7", "7", {"weight": 9}) == 1.0


@given(
    st.integers(2, 6).flatmap(
        lambda n: st.lists(
            st.lists(st.sampled_from([1.0, -1.0, 0.5, None]), min_size=n, max_size=n), min_size=1, max_size=4
        )
    ),
    st.randoms(use_true_random=False),
)
def test_pass_at_k_stays_unbiased_for_plus_minus_one_and_remote_rewards(rewards: list[list], rnd) -> None:
    """dapo's -1 and a remote reward's 0.5/None are failures at threshold 1.0; pass@k equals the
    fraction of k-subsets of each prompt's samples holding a success, averaged over prompts."""
    import itertools

    from pinned_eval.scoring.metrics import ScoredSample, dataset_metrics

    n = len(rewards[0])
    samples = [
        ScoredSample(p, j, "", 1, r, False, "3") for p, row in enumerate(rewards) for j, r in enumerate(row)
    ]
    rnd.shuffle(samples)  # generation order is not prompt order
    metrics = dataset_metrics("d", samples, pass_at_k=True, pass_threshold=1.0)
    k = 1
    while k <= n:
        per_prompt = [
            sum(any(row[i] == 1.0 for i in subset) for subset in itertools.combinations(range(n), k))
            / len(list(itertools.combinations(range(n), k)))
            for row in rewards
        ]
        assert metrics[f"eval/d-pass@{k}"] == pytest.approx(sum(per_prompt) / len(per_prompt), abs=1e-12)
        k *= 2
