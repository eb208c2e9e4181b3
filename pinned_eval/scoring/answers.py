"""Helpers shared by every reward module (the one owner: `rewards`, `math_rewards` and
`miles_rewards` import from here, never from each other's internals).

- `RewardRefused`: a row miles' reward would raise on (a dapo label that is not a number, an f1
  label that is not a string, ...). It is never turned into a score: the eval point is skipped as
  `reward_unavailable` (see `pinned_eval.skip_mapping`).
- `Label`: a label as miles sees it, with its JSON type kept (str, int or float; an object or a
  list, as search-r1's `{"ground_truth": ...}`, for custom rewards and generate functions only:
  the loader refuses one for a built-in reward).
- `last_boxed`: the last `\\boxed{...}` (or `\\boxed x`) of a text, as miles extracts it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

Label = str | int | float | dict[str, Any] | list[Any]


class RewardRefused(ValueError):
    """miles' reward raises on this row: refused, never scored (the message names the row's problem)."""


class RewardTypeError(TypeError):
    """A custom reward returned something that is neither a real number nor None."""


class RewardFn(Protocol):
    """A reward: `metadata` is the row's metadata (optional for callers)."""

    def __call__(self, response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float | None: ...


def last_boxed(text: str) -> str | None:
    """Content of the last box of `text`, or None when there is none.

    Rules (miles' extraction): the last `\\boxed` and the brace group that follows it, nested braces
    kept. An unbalanced group is no box; so are `\\boxed 5` (no braces: miles scores 0) and a lone
    `\\fbox{}`.
    """
    start = text.rfind("\\boxed")
    if start < 0:
        return None  # a lone \fbox{} is found but is not a \boxed{}: miles gives no answer
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                group = text[start : j + 1]
                return group[len("\\boxed{") : -1] if group.startswith("\\boxed{") else None
    return None


def boxed_content(response: str) -> str:
    """What miles' `boxed_` prefix hands to the rm type: the last box's content, "" without one."""
    return last_boxed(response) or ""


def require_str_label(rm_type: str, label: Label) -> str:
    """The label when it is a string; a number is refused (miles' string operations raise on it)."""
    if not isinstance(label, str):
        raise RewardRefused(f"{rm_type}: label {label!r} is a {type(label).__name__}, miles needs a string")
    return label
