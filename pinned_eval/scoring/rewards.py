"""Reward functions `(response, label, metadata=None) -> float | None` and their registry.

`metadata` is the row's metadata (see `pinned_eval.scoring.loader`); rewards that need it (e.g.
`gpqa`) read it, the others ignore it. Rules (each documented on its function):
- `exact_match`: 1.0 when the response's first token equals the label, else 0.0.
- `math`: 1.0 when the last `\\boxed{...}` of the response equals the label after normalisation
  (strings, or numbers compared exactly as fractions), else 0.0; no `\\boxed{}` scores 0.0
  (miles' verl-style grader does the same).
- `f1`: SQuAD token-level F1 in [0, 1].
- miles' rm types `deepscaler`, `dapo`, `gpqa`: see `pinned_eval.scoring.miles_rewards`.
- `remote_rm`: a scoring service (miles' `--rm-url`); scored by `pinned_eval.scoring.remote`,
  so `get_reward("remote_rm")` raises.
- `custom:<module:function>` or `custom:<module.function>`: any importable function
  `(response, label)` or `(response, label, metadata)` (a third parameter gets the row's
  metadata). It must return a real number or None (None is counted as a none-reward by the
  metrics); anything else raises `RewardTypeError`. Exceptions it raises propagate unchanged —
  the eval-point flow turns them into a `crashed` point.
`check_reward_name` validates a name's syntax without importing anything (custom modules may only
exist where the flow runs); `get_reward` imports and returns the callable.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping
from fractions import Fraction
from functools import lru_cache
from typing import Any, Protocol


class RewardFn(Protocol):
    """A reward: `metadata` is the row's metadata (optional for callers)."""

    def __call__(self, response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float | None: ...


CUSTOM_PREFIX = "custom:"
REMOTE_REWARD = "remote_rm"
_CUSTOM_PATH = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*|\.[A-Za-z_]\w*)$")


class RewardTypeError(TypeError):
    """A custom reward returned something that is neither a real number nor None."""


# ---------------------------------------------------------------------------- exact match


def exact_match(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """1.0 iff the first whitespace-separated token of the response's first non-empty line equals
    the stripped label. So "7", " 7\\n3+4=7" and "7 is it" all match label "7"; "77" and "" do not.
    """
    target = label.strip()
    for line in response.strip().splitlines():
        tokens = line.split()
        if tokens:
            return 1.0 if tokens[0] == target else 0.0
    return 1.0 if target == "" else 0.0


# ---------------------------------------------------------------------------- math


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces kept), or `\\boxed 5`; None
    when there is none or its braces are unbalanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", i):  # "\boxed 5" form: up to the next space or "$"
        return re.split(r"[\s$]", text[i + 1 :], maxsplit=1)[0] or None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


_REPLACEMENTS = (
    ("\n", " "),
    ("$", ""),
    ("\\left", ""),
    ("\\right", ""),
    ("\\!", ""),
    ("\\,", " "),
    ("\\;", " "),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\%", ""),
    ("%", ""),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
)
_NUMBER = r"-?(?:\d+(?:\.\d*)?|\.\d+)"
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")
_NUMBER_THEN_UNITS = re.compile(
    rf"^({_NUMBER})(?:\s*\\(?:text|mbox|mathrm)\{{[^{{}}]*\}}|\s+[A-Za-z][A-Za-z ]*)$"
)
_FRAC = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_SQRT_SHORT = re.compile(r"\\sqrt(\w)")


def _paren(part: str) -> str:
    return part if re.fullmatch(r"[\w.]+", part) else f"({part})"


def normalize_math_answer(answer: str) -> str:
    """Canonical string form of a math answer. Applied, in order: take the `\\boxed{}` content if
    any; drop `$`, newlines, `\\left`/`\\right`, thin spaces (`\\!`, `\\,`, `\\;`), degrees and `%`;
    drop units after a number (`5\\text{ cm}`, `5 cm`); unwrap `\\text{}`/`\\mbox{}`/`\\mathrm{}`;
    `\\dfrac`/`\\tfrac` -> `\\frac`; `\\frac{a}{b}` and `\\frac12` -> `a/b` (non-atomic parts
    parenthesised); `\\sqrt2` -> `\\sqrt{2}`; remove spaces; `x=5` -> `5` (short left side);
    thousands commas (`1,000` -> `1000`); trailing `.`; trailing `.0…` on integers.
    """
    s = answer.strip()
    boxed = extract_boxed(s)
    if boxed is not None:
        s = boxed
    for old, new in _REPLACEMENTS:
        s = s.replace(old, new)
    s = s.strip().rstrip(".").strip()
    units = _NUMBER_THEN_UNITS.match(s)
    if units:
        s = units.group(1)
    s = _TEXT_CMD.sub(r"\1", s)
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    while (m := _FRAC.search(s)) is not None:
        s = s[: m.start()] + f"{_paren(m.group(1).strip())}/{_paren(m.group(2).strip())}" + s[m.end() :]
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = s.rstrip(".")
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)
    return s


def _as_number(s: str) -> Fraction | None:
    if not re.fullmatch(rf"{_NUMBER}(?:/{_NUMBER})?", s):
        return None
    num, _, den = s.partition("/")
    try:
        return Fraction(num) / Fraction(den) if den else Fraction(num)
    except ZeroDivisionError:
        return None


def math_answer(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """1.0 iff the response's last `\\boxed{}` answer equals the label after
    `normalize_math_answer`, either as strings or as exact numbers (so `\\frac{1}{2}` == `0.5` ==
    `1/2`, `1,000` == `1000.0`); 0.0 when the response has no `\\boxed{}`."""
    boxed = extract_boxed(response)
    if boxed is None:
        return 0.0
    pred, gold = normalize_math_answer(boxed), normalize_math_answer(label)
    if pred == gold and pred != "":
        return 1.0
    p, g = _as_number(pred), _as_number(gold)
    return 1.0 if p is not None and g is not None and p == g else 0.0


# ---------------------------------------------------------------------------- f1

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_f1_text(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def f1(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """SQuAD token F1 between response and label; if either side has no tokens, 1.0 iff both empty."""
    pred, gold = normalize_f1_text(response).split(), normalize_f1_text(label).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


# ---------------------------------------------------------------------------- registry

BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "math": math_answer, "f1": f1}
# miles' rm types implemented in pinned_eval.scoring.miles_rewards (imported on first use)
MILES_REWARDS = ("deepscaler", "dapo", "gpqa")
REWARD_NAMES = (*BUILTIN_REWARDS, *MILES_REWARDS, REMOTE_REWARD)


def check_reward_name(name: str) -> str:
    """Validate a reward name's syntax (no import); return it unchanged."""
    if name in REWARD_NAMES:
        return name
    if name.startswith(CUSTOM_PREFIX):
        if _CUSTOM_PATH.match(name.removeprefix(CUSTOM_PREFIX)):
            return name
        raise ValueError(
            f"reward {name!r}: expected 'custom:<module:function>' or 'custom:<module.function>'"
        )
    raise ValueError(f"reward {name!r}: unknown (use one of {sorted(REWARD_NAMES)} or 'custom:<module:function>')")


@lru_cache(maxsize=64)
def get_reward(name: str) -> RewardFn:
    """The reward callable for `name`; custom rewards are imported and wrapped to check their result."""
    check_reward_name(name)
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if name in MILES_REWARDS:
        from pinned_eval.scoring import miles_rewards

        fn: RewardFn = getattr(miles_rewards, name)
        return fn
    if name == REMOTE_REWARD:
        raise ValueError("reward 'remote_rm' is scored by pinned_eval.scoring.remote.score_responses")
    dotted = name.removeprefix(CUSTOM_PREFIX)
    module_name, sep, attr = dotted.partition(":")
    if not sep:
        module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r} ({exc})") from exc
    custom = getattr(module, attr, None)
    if not callable(custom):
        raise ValueError(f"reward {name!r}: {module_name!r} has no callable {attr!r}")
    return _checked(name, custom)


def _takes_metadata(fn: Callable[..., object]) -> bool:
    """True when `fn` accepts a third positional argument (or *args) for the row's metadata."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: call with two arguments
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _checked(name: str, fn: Callable[..., object]) -> RewardFn:
    with_metadata = _takes_metadata(fn)

    def reward(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float | None:
        # exceptions propagate: the flow records a crashed point
        value = fn(response, label, dict(metadata or {})) if with_metadata else fn(response, label)
        if value is None:
            return None
        if isinstance(value, numbers.Real) and value == value:  # numpy scalars too; excludes NaN
            return float(value)
        raise RewardTypeError(
            f"reward {name!r} returned {value!r} ({type(value).__name__}); expected a float or None"
        )

    reward.__name__ = f"custom_reward[{name}]"
    return reward
