"""`miles.rollout.sglang_rollout` as pinned-eval serves it: `GenerateState`.

`GenerateState(args)` is a process singleton as in miles (the first `args` wins): `args`,
`tokenizer` (the pinned snapshot's, from `args.hf_checkpoint`; None without one), `processor`
(None), `sampling_params` (the rollout defaults) and `generate_fn_semaphore`.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["GenerateState"]


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
        self.tokenizer = None
        checkpoint = getattr(args, "hf_checkpoint", None)
        if checkpoint:
            from pinned_eval.prompts import load_tokenizer

            self.tokenizer = load_tokenizer(checkpoint)
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
