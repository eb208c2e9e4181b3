"""Reward functions: exact match, math (boxed + normalisation), SQuAD F1, custom loading, registry."""

from __future__ import annotations

import importlib
import itertools
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pinned_eval.scoring.answers import last_boxed
from pinned_eval.scoring.math_rewards import math_answer
from pinned_eval.scoring.miles_rewards import f1
from pinned_eval.scoring.rewards import (
    RewardTypeError,
    check_reward_name,
    exact_match,
    get_reward,
)

_module_ids = itertools.count()


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("7", "7", 1.0),
        (" 7\n", "7", 1.0),
        ("7\n3+4=7", "7", 1.0),
        ("\n\n12 and more", " 12 ", 1.0),
        ("77", "7", 0.0),
        ("7.", "7", 0.0),
        ("", "7", 0.0),
        ("  \n ", "7", 0.0),
        ("8\n7", "7", 0.0),
        ("x 7", "7", 0.0),
    ],
)
def test_exact_match_first_token_rule(response: str, label: str, expected: float) -> None:
    assert exact_match(response, label) == expected


@given(st.integers(-999, 999), st.text(alphabet=" \n\t+=0123456789", max_size=12))
def test_exact_match_any_suffix_after_whitespace(answer: int, tail: str) -> None:
    assert exact_match(f"{answer}\n{tail}", str(answer)) == 1.0
    assert exact_match(f"{answer}0{tail}", str(answer)) == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, {2}\\}}", "\\{1, {2}\\}"),
        ("$\\boxed 7$", None),  # miles reads no box without braces
        ("\\fbox{x}", None),
        ("\\boxed{unbalanced", None),
        ("no box here", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("so \\boxed{42}", "42", 1.0),
        ("\\boxed{42.0}", "42", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{-3}", "-3.00", 1.0),
        ("\\boxed{\\left(1,2\\right)}", "(1, 2)", 1.0),
        ("\\boxed{x=5}", "5", 1.0),
        ("\\boxed{x=5}", "$5$", 0.0),  # miles: `x=` is dropped by one normaliser, `$` by the other
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),  # symbolic equivalence
        ("\\boxed{2\\sqrt2}", "\\sqrt{8}", 1.0),
        ("\\boxed{6/8}", "3/4", 0.0),  # an unreduced fraction is wrong
        ("$\\boxed{0.333}$", "\\frac{1}{3}", 0.0),
        ("the answer is 42", "42", 0.0),
        ("\\boxed 42", "42", 0.0),
        ("\\boxed{43}", "42", 0.0),
        ("\\boxed{}", "", 0.0),
        ("\\boxed{0}", 0, 0.0),  # miles: a falsy label scores 0
        ("\\boxed{5}", 5, 1.0),
    ],
)
def test_math_answer(response: str, label: str | int, expected: float) -> None:
    assert math_answer(response, label) == expected


@given(st.integers(-(10**9) + 1, 10**9 - 1))  # miles' comma rule misreads 1,000,000,000
def test_math_answer_integer_forms_agree(n: int) -> None:
    assert math_answer(f"\\boxed{{{n:,}}}", str(n)) == 1.0
    assert math_answer(f"\\boxed{{{n}.0}}", str(n)) == 1.0
    assert math_answer(f"\\boxed{{{n + 1}}}", str(n)) == 0.0


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("The Eiffel Tower!", "eiffel tower", 1.0),
        ("Paris France", "Paris", 2 * (0.5 * 1.0) / 1.5),
        ("a the", "", 0.0),  # no common token, both empty included
        ("yes", "yes it is", 0.0),  # yes/no/noanswer must match exactly
        ("", "x", 0.0),
        ("blue", "red", 0.0),
        ("the cat sat on the mat", "a cat on a mat", 2 * 0.75 * 1.0 / 1.75),
    ],
)
def test_f1_squad(response: str, label: str, expected: float) -> None:
    assert f1(response, label) == pytest.approx(expected)


def test_f1_counts_repeated_tokens_once_per_match() -> None:
    # pred: [x, x, y] gold: [x, y, y] -> common = 2, p = r = 2/3
    assert f1("x x y", "x y y") == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------- registry and custom


@pytest.mark.parametrize("name", ["exact_match", "math", "f1"])
def test_builtin_registry(name: str) -> None:
    assert get_reward(name) is {"exact_match": exact_match, "math": math_answer, "f1": f1}[name]


@pytest.mark.parametrize("bad", ["bleu", "custom:", "custom:1mod.fn", "custom:mod", "custom:a b.c", "Math"])
def test_bad_reward_names_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="reward"):
        check_reward_name(bad)


def _custom_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> str:
    name = f"user_rewards_{next(_module_ids)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


_CUSTOM = """
    import numpy as np

    calls = []

    def length_ratio(response, label):
        calls.append((response, label))
        return len(response) / len(label)

    def maybe(response, label):
        return None if response == "?" else 1

    def numpy_score(response, label):
        return np.float32(0.25)

    def wrong_type(response, label):
        return "1.0"

    def nan(response, label):
        return float("nan")

    def boom(response, label):
        raise KeyError("grader exploded")

    not_callable = 3
"""


@pytest.mark.parametrize("sep", [":", "."])
def test_custom_reward_loaded_by_either_separator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sep: str
) -> None:
    mod = _custom_module(tmp_path, monkeypatch, _CUSTOM)
    fn = get_reward(f"custom:{mod}{sep}length_ratio")
    assert fn("abcd", "ab") == 2.0
    assert isinstance(fn("abcd", "ab"), float)
    assert importlib.import_module(mod).calls == [("abcd", "ab"), ("abcd", "ab")]


def test_custom_reward_results_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _custom_module(tmp_path, monkeypatch, _CUSTOM)
    maybe = get_reward(f"custom:{mod}:maybe")
    assert maybe("?", "x") is None
    assert maybe("ok", "x") == 1.0 and isinstance(maybe("ok", "x"), float)
    assert get_reward(f"custom:{mod}:numpy_score")("a", "b") == 0.25
    with pytest.raises(RewardTypeError, match=r"wrong_type' returned '1\.0' \(str\)"):
        get_reward(f"custom:{mod}:wrong_type")("a", "b")
    with pytest.raises(RewardTypeError, match="nan"):
        get_reward(f"custom:{mod}:nan")("a", "b")


def test_custom_reward_exceptions_propagate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _custom_module(tmp_path, monkeypatch, _CUSTOM)
    with pytest.raises(KeyError, match="grader exploded"):
        get_reward(f"custom:{mod}:boom")("a", "b")


def test_custom_reward_load_errors_name_the_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _custom_module(tmp_path, monkeypatch, _CUSTOM)
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_module_xyz'"):
        get_reward("custom:no_such_module_xyz:fn")
    with pytest.raises(ValueError, match=rf"'{mod}' has no callable 'not_callable'"):
        get_reward(f"custom:{mod}:not_callable")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        get_reward(f"custom:{mod}.missing")
