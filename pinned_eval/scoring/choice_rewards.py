"""miles' multiple-choice rm type `gpqa` (1.0 / 0.0); `boxed_gpqa` is built in `rewards`.

Graded as miles' `compute_gpqa_reward` at 31f1ca9 grades (tests/data/miles_rewards_golden.jsonl and
tests/data/gpqa_labels_golden.jsonl hold its outputs). Choices: `metadata["choices"]`, a list in
A.. order, or a dict whose *values* are taken in the dict's order (its keys are not read).

Valid letters: `metadata["valid_letters"]` (a string or list, each upper-cased) when non-empty,
else the first `len(choices)` letters when there are choices, else A-H.

The correct letter:
1. `metadata["correct_letter"]` when it is a string (stripped, upper-cased, even one that is not a
   valid letter; an empty one counts as none; a number is ignored);
2. a string label: when none is given, the label itself if it is one valid letter (any case,
   surrounding spaces ignored; `(B)` and `B.` are not);
3. a numeric label is `int(label)` (truncated: `2.5` is 2, `-0.5` is 0) and, when that indexes
   the valid letters, replaces any `correct_letter`; a NaN or infinite label is refused
   (`RewardRefused`: miles raises);
4. still none, with choices: the letter at the position of the first choice whose normalised
   text equals the string label's (that choice then stands for `correct_answer` when the row
   has none); a position past the valid letters is refused (miles raises).
Normalised text: lower case, every run of non-alphanumerics one space, stripped.

The predicted letter is read from the text after the last `</think>`: the first match of
`answer|option|choice`, optional `is` or `:`, then a letter (case-insensitive, so `answer is c`
reads C); else `X is (the) correct`; else `final answer|option (is|:) X`; each pattern's first
match only, kept when it is a valid letter. Failing those, the *last* capital letter standing alone
that is a valid letter.

With a correct letter and a predicted one, the reward is 1.0 iff they are equal. Otherwise 1.0
iff the normalised text of the correct choice, of `correct_answer`, of `answer_text` or of the
string label occurs in the normalised response (a substring); else, with a predicted letter, no
correct one and a string label, 1.0 iff the letter equals the stripped upper-cased label. An empty response
scores 0.0 (its row's label is still read: a NaN label is refused).
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping
from typing import Any

from pinned_eval.scoring.answers import Label, RewardRefused

_DEFAULT_LETTERS = list("ABCDEFGH")
_PATTERNS = (
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*([a-z])", re.IGNORECASE),
    re.compile(r"([a-z])\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
    re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*([a-z])", re.IGNORECASE),
)
_LONE_CAPITAL = re.compile(r"\b([A-Z])\b")


def normalize_choice_text(text: str) -> str:
    """Lower case, every run of non-alphanumerics one space, stripped."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1]


def _choices(meta: Mapping[str, Any]) -> list[Any]:
    given = meta.get("choices")
    if given is None:
        return []
    if isinstance(given, Mapping):
        return list(given.values())
    try:
        return list(given)
    except TypeError as exc:
        raise RewardRefused(f"gpqa: metadata choices {given!r:.80} are not a list or a mapping") from exc


def _valid_letters(meta: Mapping[str, Any], choices: list[Any]) -> list[str]:
    given = meta.get("valid_letters")
    if given:
        return [str(v).upper() for v in given]
    return list(string.ascii_uppercase[: len(choices)]) if choices else list(_DEFAULT_LETTERS)


def _label_index(label: int | float) -> int:
    if isinstance(label, float) and not math.isfinite(label):
        raise RewardRefused(f"gpqa: label {label!r} is not a finite number (miles raises on it)")
    return int(label)


def _correct(label: Label, meta: Mapping[str, Any], letters: list[str], choices: list[Any]) -> tuple[str, Any]:
    """(the correct letter or "", the `correct_answer` the text fallback reads)."""
    given = meta.get("correct_letter")
    correct = given.strip().upper() if isinstance(given, str) else ""
    answer = meta.get("correct_answer")
    if isinstance(label, str):
        text = label.strip()
        if len(text) == 1 and text.upper() in letters and not correct:
            correct = text.upper()
    elif isinstance(label, int | float):
        idx = _label_index(label)
        if 0 <= idx < len(letters):
            correct = letters[idx]
    if not correct and choices and isinstance(label, str) and label.strip():
        wanted = normalize_choice_text(label.strip())
        for idx, choice in enumerate(choices):
            if normalize_choice_text(str(choice)) == wanted:
                if idx >= len(letters):
                    raise RewardRefused(f"gpqa: choice {idx + 1} has no valid letter ({len(letters)} given)")
                correct = letters[idx]
                answer = choice if "correct_answer" not in meta else answer
                break
    return correct, answer


def predicted_letter(response: str, letters: list[str]) -> str | None:
    """The letter the response picks (see the module docstring), or None."""
    if not response:
        return None
    text = _after_thinking(response)
    valid = {letter.upper() for letter in letters}
    for pattern in _PATTERNS:
        m = pattern.search(text)
        if m is not None and m.group(1).upper() in valid:
            return m.group(1).upper()
    lone = [c for c in _LONE_CAPITAL.findall(text) if c in valid]
    return lone[-1] if lone else None


def gpqa(response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float:
    """miles' `gpqa` (see the module docstring)."""
    meta = metadata or {}
    choices = _choices(meta)
    letters = _valid_letters(meta, choices)
    correct, answer = _correct(label, meta, letters, choices)
    predicted = predicted_letter(response, letters)
    if predicted and correct:
        return 1.0 if predicted == correct else 0.0
    targets = []
    if correct and correct in letters and letters.index(correct) < len(choices):
        targets.append(str(choices[letters.index(correct)]))
    targets += [str(v) for v in (answer, meta.get("answer_text")) if v]
    label_text = label.strip() if isinstance(label, str) else ""
    if label_text:
        targets.append(label_text)
    haystack = normalize_choice_text(_after_thinking(response))
    if any((needle := normalize_choice_text(t)) and needle in haystack for t in targets):
        return 1.0
    if predicted and not correct and label_text:
        return 1.0 if predicted == label_text.upper() else 0.0
    return 0.0
