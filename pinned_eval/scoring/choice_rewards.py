"""miles' multiple-choice rm type `gpqa` (1.0 / 0.0); `boxed_gpqa` is built in `rewards`.

Valid letters: `metadata["valid_letters"]` (a string or list, upper-cased) when non-empty, else A-H.

The correct letter, first that applies:
1. `metadata["correct_letter"]`: a letter (any case), or an int index into the valid letters;
2. the label when it is a valid letter (any case, surrounding spaces ignored; `(B)` is not one);
3. an integral numeric label: an index into the valid letters;
4. the letter of the choice (`metadata["choices"]`, a list in A.. order or a letter->text dict)
   whose normalised text equals the label's, else the one equal to `metadata["correct_answer"]`.
Normalised text: lower case, every run of non-alphanumerics one space, stripped.

The predicted letter is read from the text after the last `</think>`, trying in order (each
pattern's first match only; a match that is not a valid letter moves on to the next pattern):
`option X` (case-insensitive), `answer X` / `answer is X` / `answer: X` (case-insensitive,
newlines allowed), `choice X` (case-insensitive), `(X)` (capital), and finally the *last* capital
letter standing alone that is a valid letter.

With a correct letter and a predicted one, the reward is 1.0 iff they are equal. Otherwise (no
prediction, or no correct letter) it falls back to text: 1.0 iff the normalised text of the label
(a string label), of the correct choice, or of `correct_answer` occurs in the normalised response
(a substring match, as miles does). An empty response scores 0.0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pinned_eval.scoring.answers import Label

_DEFAULT_LETTERS = "ABCDEFGH"
_PATTERNS = (
    re.compile(r"(?i)option\s*\(?([A-Z])\)?"),
    re.compile(r"(?i)answer\s*(?:is|:)?\s*\(?([A-Z])\)?"),
    re.compile(r"(?i)choice\s*\(?([A-Z])\)?"),
    re.compile(r"\(([A-Z])\)"),
)
_LONE_CAPITAL = re.compile(r"\b([A-Z])\b")


def normalize_choice_text(text: str) -> str:
    """Lower case, every run of non-alphanumerics one space, stripped."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _valid_letters(meta: Mapping[str, Any]) -> list[str]:
    given = meta.get("valid_letters")
    if given:
        return [str(v).strip().upper() for v in given]
    return list(_DEFAULT_LETTERS)


def _choice_texts(meta: Mapping[str, Any], letters: list[str]) -> dict[str, str]:
    choices = meta.get("choices")
    if isinstance(choices, Mapping):
        return {str(k).strip().upper(): str(v) for k, v in choices.items()}
    if isinstance(choices, list | tuple):
        return {chr(ord("A") + i): str(v) for i, v in enumerate(choices)}
    return {}


def _index_letter(value: object, letters: list[str]) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        return None
    idx = int(value)
    return letters[idx] if 0 <= idx < len(letters) else None


def _correct_letter(label: Label, meta: Mapping[str, Any], letters: list[str], texts: dict[str, str]) -> str | None:
    given = meta.get("correct_letter")
    if isinstance(given, str) and given.strip().upper() in letters:
        return given.strip().upper()
    if (by_index := _index_letter(given, letters)) is not None:
        return by_index
    if isinstance(label, str) and label.strip().upper() in letters:
        return label.strip().upper()
    if (by_index := _index_letter(label, letters)) is not None:
        return by_index
    for wanted in (label, meta.get("correct_answer")):
        if isinstance(wanted, str) and normalize_choice_text(wanted):
            for letter, text in texts.items():
                if normalize_choice_text(text) == normalize_choice_text(wanted):
                    return letter
    return None


def predicted_letter(response: str, letters: list[str]) -> str | None:
    """The letter the response picks (see the module docstring), or None."""
    text = response.rsplit("</think>", 1)[-1]
    for pattern in _PATTERNS:
        m = pattern.search(text)
        if m is not None and m.group(1).upper() in letters:
            return m.group(1).upper()
    lone = [c for c in _LONE_CAPITAL.findall(text) if c in letters]
    return lone[-1] if lone else None


def gpqa(response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float:
    """miles' `gpqa` (see the module docstring)."""
    if not response or not response.strip():
        return 0.0
    meta = metadata or {}
    letters = _valid_letters(meta)
    texts = _choice_texts(meta, letters)
    correct = _correct_letter(label, meta, letters, texts)
    predicted = predicted_letter(response, letters)
    if correct is not None and predicted is not None:
        return 1.0 if predicted == correct else 0.0
    haystack = normalize_choice_text(response.rsplit("</think>", 1)[-1])
    candidates = [label if isinstance(label, str) else None, texts.get(correct or ""), meta.get("correct_answer")]
    for candidate in candidates:
        if isinstance(candidate, str) and (needle := normalize_choice_text(candidate)) and needle in haystack:
            return 1.0
    return 0.0
