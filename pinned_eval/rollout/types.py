"""The one per-sample record every rollout kind returns: `Sample`.

`score`, the results tables (`pinned_eval.results.tables`), the cache and every sink read it.
Contract:
- the single-turn fields (dataset .. prompt_tokens) are what the engine returned for one
  (dataset, prompt, sample) and are always set; `label` keeps its JSON type;
- the agentic fields are optional and default to "not recorded" (None), so a single-turn sample,
  a stored generation read back and a rescored one are unchanged: `messages` (the transcript,
  chat messages), `turns` (model calls that made it), `tool_calls` (as the model emitted them),
  `status` (how the rollout ended, miles' `Sample.Status` names: completed, truncated, aborted,
  failed), `reward` (a reward the rollout itself set, e.g. by a miles generate function; None:
  the dataset's reward scores it) and `usage` (tokens and requests the rollout spent).
- frozen (a record, not a workspace).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.scoring.answers import Label

if TYPE_CHECKING:
    from pinned_eval.datasets.loader import EvalSample
    from pinned_eval.datasets.spec import ResolvedDataset

__all__ = ["Produce", "Sample", "Usage"]


class Usage(BaseModel):
    """What one rollout spent: model requests and tokens (summed over its turns)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests: int = Field(default=0, ge=0, description="Model calls (one per turn).")
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)


class Sample(BaseModel):
    """One sample of one prompt: what the rollout produced (see the module docstring)."""

    model_config = ConfigDict(frozen=True)

    dataset: str
    prompt_index: int
    sample_index: int
    prompt: str
    label: Label  # the row's label with its JSON type (miles' rewards see it typed; an object too)
    metadata: dict[str, Any]
    response: str
    response_len: int
    finish_reason: str | None
    weight_version: str | None
    prompt_tokens: int | None = None
    # agentic rollouts (optional; None = not recorded)
    messages: list[dict[str, Any]] | None = None
    turns: int | None = None
    tool_calls: list[dict[str, Any]] | None = None
    status: str | None = None
    reward: float | None = None
    usage: Usage | None = None


# one rollout of (dataset, row, sample index j) → its Sample (or several: a miles generate function
# returning list[Sample]); what a rollout kind's `open` yields
Produce = Callable[["ResolvedDataset", "EvalSample", int], Awaitable["Sample | list[Sample]"]]
