"""`miles.rollout.rm_hub` as pinned-eval serves it: `async_rm`, `batched_async_rm`.

`async_rm(args, sample)`: `args.custom_rm_path` (miles' `async (args, sample)` function) when set;
otherwise the rm type (`sample.metadata["rm_type"]`, else `args.rm_type`) scored by pinned-eval's
golden-tested rewards (`pinned_eval.scoring.rewards.get_reward`) on (response, label, metadata).
`batched_async_rm(args, samples)`: `async_rm` of each, in order.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from pinned_eval.agentic.compat.misc import load_function
from pinned_eval.agentic.compat.types import Sample

__all__ = ["async_rm", "batched_async_rm"]


async def async_rm(args: Any, sample: Sample, **kwargs: Any) -> Any:
    custom = getattr(args, "custom_rm_path", None)
    if custom:
        result = load_function(custom)(args, sample, **kwargs)
        return await result if inspect.isawaitable(result) else result
    rm_type = (sample.metadata or {}).get("rm_type") or getattr(args, "rm_type", None)
    if not rm_type:
        raise ValueError("async_rm: no rm_type (args.rm_type and metadata['rm_type'] are unset)")
    from pinned_eval.scoring.rewards import get_reward

    return get_reward(rm_type)(sample.response, sample.label, sample.metadata)


async def batched_async_rm(args: Any, samples: list[Sample], **kwargs: Any) -> list[Any]:
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))
