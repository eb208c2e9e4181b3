"""`miles.rollout.sglang_rollout` as pinned-eval serves it: `GenerateState`.

`GenerateState(args)` is a process singleton as in miles (the first `args` wins): `args`,
`tokenizer` (the pinned snapshot's, from `args.hf_checkpoint`; None without one), `processor`
(None), `sampling_params` (the rollout defaults) and `generate_fn_semaphore`.
`tokenizer` is loaded on first use, not when the state is made (miles loads it eagerly): loading
it imports `transformers` (and torch), seconds in a fresh runner, which a function that never
reads it (an agent function over chat completions) does not pay (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["GenerateState"]

_UNLOADED = object()


class GenerateState:
    _instance: GenerateState | None = None

    def __new__(cls, args: Any = None) -> GenerateState:
        if cls._instance is None:
            instance = super().__new__(cls)
            instance._init(args)
            cls._instance = instance
        return cls._instance

    def _init(self, args: Any) -> None:
        self.args = args
        self.processor = None
        self._tokenizer: Any = _UNLOADED
        self.generate_fn_semaphore = asyncio.Semaphore(max(1, int(getattr(args, "sglang_server_concurrency", 1) or 1)))
        self.sampling_params: dict[str, Any] = {
            "temperature": getattr(args, "rollout_temperature", 1.0),
            "top_p": getattr(args, "rollout_top_p", 1.0),
            "top_k": getattr(args, "rollout_top_k", -1),
            "max_new_tokens": getattr(args, "rollout_max_response_len", 1024),
            "stop": getattr(args, "rollout_stop", None),
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }

    def __init__(self, args: Any = None) -> None:  # state is set once, in __new__
        return None

    @property
    def tokenizer(self) -> Any:
        """The pinned snapshot's tokenizer, loaded on first use (None without `hf_checkpoint`)."""
        if self._tokenizer is _UNLOADED:
            checkpoint = getattr(self.args, "hf_checkpoint", None)
            if checkpoint:
                from pinned_eval.prompts import load_tokenizer

                self._tokenizer = load_tokenizer(checkpoint)
            else:
                self._tokenizer = None
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:  # miles code may set its own
        self._tokenizer = value
