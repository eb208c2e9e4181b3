"""miles' custom reward functions (`--custom-rm-path`): `async def reward(args, sample)`.

Contract: `miles_sample_reward(name, fn)` wraps such a function as a pinned-eval reward. Each call
builds a `MilesSample` carrying the fields miles' reward functions read (`prompt`, `response`,
`label`, `metadata`, `status`, plus `reward=None`, `index`) and passes `args`, a namespace built
from the suite (`EvalSuite.miles_args`: `rm_type`, `custom_rm_path`, `n_samples_per_eval_prompt`,
`eval_temperature`, ...). The coroutine runs to completion on its own event loop in a worker
thread (the scorer may already be inside one). It must return a real number, a dict holding
`args.eval_reward_key or args.reward_key` (else `"score"`), or None (`reward_value`); anything
else raises `RewardTypeError`.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from pinned_eval.scoring.answers import Label, RewardTypeError


@dataclass
class MilesSample:
    """The sample a miles reward function reads (the subset of miles' `Sample` rewards use)."""

    prompt: str
    response: str
    label: Label
    metadata: dict[str, Any] = field(default_factory=dict)
    status: str = "completed"  # a scored response finished: miles' Sample.Status.COMPLETED
    reward: Any = None
    index: int = 0


def is_miles_sample_reward(fn: Callable[..., object]) -> bool:
    """True for `async def f(args, sample)` (two positional parameters, a coroutine function)."""
    if not inspect.iscoroutinefunction(fn):
        return False
    params = inspect.signature(fn).parameters.values()
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) == 2


def eval_reward_key(args: Any) -> str | None:
    """miles' eval rule: `args.eval_reward_key or args.reward_key` (None: neither set)."""
    return getattr(args, "eval_reward_key", None) or getattr(args, "reward_key", None)


def reward_value(name: str, raw: object, key: str | None) -> float | None:
    """The scalar of a reward as miles' eval takes it (`sample.reward[key]` when `key` is set,
    else `sample.reward`), with `key` being `eval_reward_key(args)`:
    - a dict: its `key` (`"score"` when no key is set: miles would log the dict itself); a
      dict without it raises `RewardTypeError` naming the key (miles: KeyError); a bool under
      the key counts 1.0 / 0.0, as miles' mean of `[True, False]` does (dapo's `acc`);
    - a real number, or None: itself, also when a key is set (miles on main indexes it and
      raises; the number is what a scalar reward means);
    - anything else raises `RewardTypeError`."""
    if isinstance(raw, Mapping):
        used = key or "score"
        if used not in raw:
            raise RewardTypeError(f"reward {name!r} returned a dict without {used!r} (eval_reward_key/reward_key): "
                                  f"{raw!r:.120}")
        raw = raw[used]
        if isinstance(raw, bool):
            return float(raw)
    if raw is None:
        return None
    if isinstance(raw, numbers.Real) and not isinstance(raw, bool) and raw == raw:
        return float(raw)
    raise RewardTypeError(f"reward {name!r} returned {raw!r} ({type(raw).__name__}); expected a float or None")


def _value(name: str, raw: object, args: SimpleNamespace) -> float | None:
    return reward_value(name, raw, eval_reward_key(args))


def miles_sample_reward(name: str, fn: Callable[..., Any]) -> Callable[..., float | None]:
    """The pinned-eval reward calling miles' `fn(args, sample)` (see the module docstring)."""

    def reward(
        response: str,
        label: Label,
        metadata: Mapping[str, Any] | None = None,
        *,
        prompt: str = "",
        args: SimpleNamespace | None = None,
    ) -> float | None:
        ns = args if args is not None else SimpleNamespace(custom_rm_path=name, reward_key=None, eval_reward_key=None)
        sample = MilesSample(prompt=prompt, response=response, label=label, metadata=dict(metadata or {}))
        with ThreadPoolExecutor(max_workers=1) as pool:  # exceptions propagate: a crashed point
            raw = pool.submit(asyncio.run, fn(ns, sample)).result()
        return _value(name, raw, ns)

    reward.__name__ = f"miles_reward[{name}]"
    reward.takes_sample = True  # type: ignore[attr-defined]
    return reward


def score_with_sample(
    fn: object, response: str, label: Label, metadata: Mapping[str, Any], *, prompt: str, args: Any
) -> float | None:
    """Call a reward made by `miles_sample_reward` with the row's prompt and the suite's args."""
    return cast(Callable[..., float | None], fn)(response, label, metadata, prompt=prompt, args=args)
