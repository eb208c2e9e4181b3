"""The `single_turn` rollout kind: one prompt, one model call, one `Sample` per (prompt, j).

Contract:
- `open` renders every prompt of its datasets with `pinned_eval.prompts.PromptRenderer` (the
  session's `tokenizer_dir`) before it yields, so a bad template or message-list prompt fails
  the point with a `PromptError` naming the dataset before any request;
- sample j of row i is one `session.generate` with the dataset's sampling parameters, the
  deterministic `sampling_seed` i * 1000 + j (an empty `stop` list is not sent) and the rid
  suffix `<dataset>-<i>-<j>`;
- its `Sample` records the prompt text as sent, the row's label and metadata, and what the
  engine returned (text, completion and prompt tokens, finish reason, weight version); the
  agentic fields stay unset.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.prompts import PromptRenderer
from pinned_eval.rollout.session import PointSession
from pinned_eval.rollout.types import Produce, Sample

__all__ = ["SingleTurn", "sampling"]


def sampling(ds: ResolvedDataset, seed: int) -> dict[str, Any]:
    """`ds`'s sampling parameters with `sampling_seed`; an empty `stop` is left out."""
    params = ds.sampling_params()
    params["sampling_seed"] = seed
    if not params.get("stop"):
        params.pop("stop", None)
    return params


class SingleTurn:
    """Today's per-sample generation (see the module docstring)."""

    name = "single_turn"

    @asynccontextmanager
    async def open(
        self,
        session: PointSession,
        datasets: Sequence[ResolvedDataset],
        rows: Mapping[str, Sequence[EvalSample]],
    ) -> AsyncIterator[Produce]:
        renderer = PromptRenderer(session.tokenizer_dir)
        prompts = {(ds.name, s.index): renderer.render(ds, s) for ds in datasets for s in rows[ds.name]}

        async def produce(ds: ResolvedDataset, sample: EvalSample, j: int) -> Sample:
            prompt = prompts[ds.name, sample.index]
            result = await session.generate(
                **prompt.request(),
                sampling_params=sampling(ds, seed=sample.index * 1000 + j),
                rid=f"{ds.name}-{sample.index}-{j}",
            )
            return Sample(
                dataset=ds.name,
                prompt_index=sample.index,
                sample_index=j,
                prompt=prompt.text,
                label=sample.label,
                metadata=sample.metadata,
                response=result.text,
                response_len=result.meta_info.completion_tokens,
                prompt_tokens=result.meta_info.prompt_tokens,
                finish_reason=result.finish_type,
                weight_version=result.meta_info.weight_version,
            )

        yield produce
