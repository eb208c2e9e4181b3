"""Reward functions `(response, label, metadata=None) -> float | None` and their registry.

`label` keeps its JSON type (str, int or float) as miles sees it (custom rewards too); `metadata` is the row's
metadata (see `pinned_eval.datasets.loader`). Rewards (each documented in its module):
- miles' rm types, scored as miles' `rm_hub.async_rm` at 31f1ca9 does (docs/rewards.md):
  `math`, `deepscaler`, `gemma_math` (`math_rewards`), `dapo`, `f1` (`miles_rewards`), `gpqa`
  (`choice_rewards`), and the `boxed_` forms `boxed_dapo`, `boxed_f1`, `boxed_gpqa` (the rm
  type applied to the content of the response's last `\\boxed{}`, "" without one). `boxed_math`
  grades like `math` (miles scores 0 on every row: a documented divergence, warned at load).
  Where miles raises on a row, the reward raises `RewardRefused` (the point is skipped as
  `reward_unavailable`, never scored).
- `ifbench`: refused by `check_reward_name` (its instruction data is not installable here).
- `exact_match`: pinned-eval's own (not a miles rm type: refused under `strict_miles`): 1.0 when
  the response's first token equals the label, else 0.0.
- `remote_rm`: a scoring service (miles' `--rm-url`); scored by `pinned_eval.scoring.remote`,
  so `get_reward("remote_rm")` raises.
- `custom:<module:function>` or `custom:<module.function>`: any importable function
  `(response, label)` or `(response, label, metadata)` (a third parameter gets the row's
  metadata), or miles' `async def f(args, sample)` (`pinned_eval.scoring.miles_custom`). It must
  return a real number or None (None is counted as a none-reward by the metrics); anything else
  raises `RewardTypeError`. Exceptions it raises propagate unchanged —
  the eval-point flow turns them into a `crashed` point.
`check_reward_name` validates a name's syntax without importing anything (custom modules may only
exist where the flow runs); `get_reward` imports and returns the callable.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from pinned_eval.plugins import is_import_path, load_object
from pinned_eval.scoring.answers import Label, RewardFn, RewardRefused, RewardTypeError, boxed_content
from pinned_eval.scoring.choice_rewards import gpqa
from pinned_eval.scoring.math_rewards import boxed_math, deepscaler, gemma_math, math_answer
from pinned_eval.scoring.miles_custom import is_miles_sample_reward, miles_sample_reward
from pinned_eval.scoring.miles_rewards import dapo, f1

__all__ = ["RewardFn", "RewardRefused", "check_reward_name", "exact_match", "get_reward"]

CUSTOM_PREFIX = "custom:"
REMOTE_REWARD = "remote_rm"


# ---------------------------------------------------------------------------- exact match


def exact_match(response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float:
    """1.0 iff the first whitespace-separated token of the response's first non-empty line equals
    the stripped label. So "7", " 7\\n3+4=7" and "7 is it" all match label "7"; "77" and "" do not.
    """
    target = str(label).strip()
    for line in response.strip().splitlines():
        tokens = line.split()
        if tokens:
            return 1.0 if tokens[0] == target else 0.0
    return 1.0 if target == "" else 0.0


# ---------------------------------------------------------------------------- registry


def _boxed(fn: RewardFn) -> RewardFn:
    def reward(response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float | None:
        return fn(boxed_content(response), label, metadata)

    return reward


_MILES_BASE: dict[str, RewardFn] = {"math": math_answer, "deepscaler": deepscaler, "gemma_math": gemma_math,
                                    "dapo": dapo, "f1": f1, "gpqa": gpqa}
MILES_REWARDS: dict[str, RewardFn] = {
    **_MILES_BASE,
    "boxed_math": boxed_math,
    **{f"boxed_{name}": _boxed(_MILES_BASE[name]) for name in ("dapo", "f1", "gpqa")},
}
BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, **MILES_REWARDS}
REWARD_NAMES = (*BUILTIN_REWARDS, REMOTE_REWARD)
# rm types miles has whose result pinned-eval deliberately does not reproduce (warned at config load)
MILES_DIVERGENCES = {
    "boxed_math": "miles' boxed_math scores 0 on every row (it hands the box's content to `math`, which "
    "needs a box); pinned-eval grades the last box like `math`",
}
_REFUSED = {
    "ifbench": "reward 'ifbench': not supported: IFBench's instruction checkers need the allenai/IFBench "
    "code and NLTK data (punkt, POS tagger) that are not installable here",
}


def check_reward_name(name: str, *, strict_miles: bool = False) -> str:
    """Validate a reward name's syntax (no import); return it unchanged. With `strict_miles`, only
    rm types miles itself knows are accepted (`exact_match` and `custom:` are pinned-eval's)."""
    if name in _REFUSED:
        raise ValueError(_REFUSED[name])
    if strict_miles and name not in (*MILES_REWARDS, REMOTE_REWARD):
        raise ValueError(
            f"reward {name!r}: not a miles rm_type (strict_miles: use one of {sorted((*MILES_REWARDS, REMOTE_REWARD))})"
        )
    if name in REWARD_NAMES:
        return name
    if name.startswith(CUSTOM_PREFIX):
        if is_import_path(name.removeprefix(CUSTOM_PREFIX)):
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
    if name == REMOTE_REWARD:
        raise ValueError("reward 'remote_rm' is scored by pinned_eval.scoring.remote.score_responses")
    custom = load_object(name.removeprefix(CUSTOM_PREFIX), expect=callable, what=f"reward {name!r}")
    if is_miles_sample_reward(custom):  # miles' --custom-rm-path form: async (args, sample)
        fn: RewardFn = miles_sample_reward(name, custom)
        return fn
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

    def reward(response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float | None:
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
