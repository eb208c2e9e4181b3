"""miles' answer-text rm types: `dapo` and `f1` (and their `boxed_` forms, built in `rewards`).

- `dapo`: DAPO's rule on the last 300 characters of the response (`<|im_end|>` dropped first):
  the last `Answer: <x>` line (case-insensitive) is the prediction ("[INVALID]" without one).
  Prediction and label go through `dapo_normalize` (the text after the last `=`, units,
  `\\text{}`, `$` dropped, `\\fracab` and `\\sqrta` braced, digit-only thousands commas removed);
  the normalised label is then read as a number, `str(int(float(label)))` (`0.5` -> `0`, `1e3` ->
  `1000`, `$5$` -> `5`), and the two must be equal strings (`0.0` is not `0`). A label that is not
  a number is refused (`RewardRefused`; miles raises ValueError). Returns DAPO's `score`: +1.0
  correct, -1.0 otherwise (miles users log `--reward-key score`).
- `f1`: SQuAD token F1 (lower case, punctuation and articles dropped). When either normalised side
  is `yes`, `no` or `noanswer`, the other must be the same or the score is 0.0; no common token
  (both empty included) is 0.0. A label that is not a string is refused (miles raises).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping
from typing import Any

from pinned_eval.scoring.answers import Label, RewardRefused, require_str_label

# ---------------------------------------------------------------------------- dapo

_DAPO_TAIL = 300
_END_OF_TURN = "<|im_end|>"  # a chat template's end-of-turn token left in the response: dropped
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
                       ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DAPO_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
                 "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
                 "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
                 "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ",
                 "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots")


def dapo_normalize(answer: str) -> str:
    """DAPO's final-answer normalisation (see the module docstring)."""
    answer = answer.split("=")[-1]
    for old, new in _DAPO_SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for gone in _DAPO_REMOVED:
        answer = answer.replace(gone, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for cmd in ("text", "textbf", "overline"):
        answer = re.sub(rf"(\\{cmd}\{{)(.*?)(\}})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _dapo_truth(label: Label) -> str:
    try:
        return str(int(float(dapo_normalize(str(label)))))
    except (ValueError, OverflowError) as exc:
        raise RewardRefused(f"dapo: label {label!r:.80} is not a number (miles reads it as int(float(label)))") from exc


def dapo(response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float:
    """miles' `dapo` score (see the module docstring)."""
    truth = _dapo_truth(label)
    found = _DAPO_ANSWER.findall(response.replace(_END_OF_TURN, "")[-_DAPO_TAIL:])
    pred = dapo_normalize(found[-1] if found else "[INVALID]")
    return 1.0 if pred == truth else -1.0


# ---------------------------------------------------------------------------- f1

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_CLOSED_ANSWERS = ("yes", "no", "noanswer")


def normalize_f1_text(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1(response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float:
    """miles' `f1` (see the module docstring)."""
    pred, gold = normalize_f1_text(response), normalize_f1_text(require_str_label("f1", label))
    if (pred in _CLOSED_ANSWERS or gold in _CLOSED_ANSWERS) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)
