"""miles' offline rm types beyond `math`/`f1`: `deepscaler`, `dapo` and `gpqa` (own implementations
of the behaviour miles' `rm_hub` documents; all `(response, label, metadata=None) -> float`).

- `deepscaler`: only the text after the first `</think>` (else after `###Response`) is graded;
  a response with neither scores 0.0. That text's last `\\boxed{}` answer is graded against the
  label like `math` (1.0 / 0.0).
- `dapo`: DAPO's rule on the last 300 characters: the last `Answer: <x>` line is the prediction,
  normalised like `math` and compared to the label; returns DAPO's `score`, +1.0 when correct and
  -1.0 otherwise (miles users log `--reward-key score`; pass@k counts +1.0 as a success).
- `gpqa`: multiple choice. The valid letters are `metadata["valid_letters"]` (a string or list),
  else one per `metadata["choices"]`, else A-D. The correct letter is the label when it is one of
  them, else `metadata["correct_letter"]`, else the letter of the choice whose text equals the
  label. The prediction is the last `\\boxed{X}`, else the last "answer is (X)" / "Answer: X",
  else the response when it is a lone letter. 1.0 iff prediction == correct letter. A row whose
  correct letter cannot be determined raises `ValueError` naming the metadata keys (a dataset
  bug, not a wrong answer).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pinned_eval.scoring.rewards import _as_number, extract_boxed, math_answer, normalize_math_answer

_THINK_END, _RESPONSE_MARK = "</think>", "###Response"
_DAPO_TAIL = 300
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def deepscaler(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """See the module docstring."""
    for mark in (_THINK_END, _RESPONSE_MARK):
        if mark in response:
            return math_answer(response.split(mark, 1)[1], label)
    return 0.0


def dapo(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """See the module docstring."""
    found = _DAPO_ANSWER.findall(response[-_DAPO_TAIL:])
    if not found or not label.strip():
        return -1.0
    pred, gold = normalize_math_answer(found[-1]), normalize_math_answer(label)
    if pred == gold and pred:
        return 1.0
    p, g = _as_number(pred), _as_number(gold)
    return 1.0 if p is not None and g is not None and p == g else -1.0


def gpqa(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """See the module docstring."""
    meta = metadata or {}
    letters = _valid_letters(meta)
    correct = _correct_letter(label, meta, letters)
    return 1.0 if _predicted_letter(response, letters) == correct else 0.0


def _valid_letters(meta: Mapping[str, Any]) -> str:
    valid = meta.get("valid_letters")
    if valid:
        return "".join(str(v).strip().upper() for v in valid)
    choices = meta.get("choices")
    if isinstance(choices, list | tuple) and choices:
        return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: len(choices)]
    return "ABCD"


def _correct_letter(label: str, meta: Mapping[str, Any], letters: str) -> str:
    stripped = label.strip().strip("()").upper()
    if len(stripped) == 1 and stripped in letters:
        return stripped
    given = str(meta.get("correct_letter") or "").strip().upper()
    if len(given) == 1 and given in letters:
        return given
    choices = meta.get("choices")
    if isinstance(choices, list | tuple):
        for letter, choice in zip(letters, choices, strict=False):
            if str(choice).strip() == label.strip():
                return letter
    raise ValueError(
        f"gpqa: label {label!r:.80} is not one of the letters {letters!r} and neither "
        "metadata['correct_letter'] nor metadata['choices'] identifies the correct letter"
    )


def _predicted_letter(response: str, letters: str) -> str | None:
    boxed = extract_boxed(response)
    if boxed is not None:
        cand = re.sub(r"\\text\{([^{}]*)\}", r"\1", boxed).strip().strip("()").upper()
        if len(cand) == 1 and cand in letters:
            return cand
    pattern = rf"(?i)(?:answer\s*(?:is|:)\s*\(?\s*)([{letters}])\b"
    found = re.findall(pattern, response)
    if found:
        return str(found[-1]).upper()
    lone = response.strip().strip("().").upper()
    return lone if len(lone) == 1 and lone in letters else None
