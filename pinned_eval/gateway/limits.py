"""What one point's gateway allows: a per-point budget and per-sample limits, and what a breach is.

Contract:
- `GatewayLimits` (frozen, unknown keys refused): `None` means unbounded. Tokens are prompt plus
  completion tokens as the replies count them (`meta_info` on `/generate`, `usage` on `/v1`);
  a call is admitted while the counts are under the limits, so the call that crosses a token limit
  completes and the next one is refused.
- per point: `max_requests`, `max_tokens` -> a breach is `AgentBudgetExceeded`, the point's skip
  `agent_budget` (`pinned_eval.skip_mapping`);
- per sample: `max_turns_per_sample` (model calls of one sample), `max_tokens_per_sample`,
  `sample_wall_s` (seconds since the sample was opened, or its first call) -> a breach refuses that
  sample's calls (HTTP 429 naming the limit); the point goes on.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.skips import EvalSkipped, SkipReason

__all__ = ["AgentBudgetExceeded", "GatewayLimits", "SampleLimitExceeded"]


class GatewayLimits(BaseModel):
    """Per-point budget and per-sample limits of a point's gateway (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_requests: int | None = Field(default=None, ge=1, description="Model calls per point.")
    max_tokens: int | None = Field(default=None, ge=1, description="Prompt + completion tokens per point.")
    max_turns_per_sample: int | None = Field(default=None, ge=1, description="Model calls per sample.")
    max_tokens_per_sample: int | None = Field(default=None, ge=1, description="Tokens per sample.")
    sample_wall_s: float | None = Field(default=None, gt=0, description="Seconds per sample.")


class AgentBudgetExceeded(EvalSkipped):
    """The point's model-call budget ran out: the point is skipped `agent_budget`."""

    def __init__(self, limit: str, value: int) -> None:
        self.limit = limit
        self.value = value
        super().__init__(SkipReason.AGENT_BUDGET, f"the point's {limit} ({value}) is used up")


class SampleLimitExceeded(Exception):
    """One sample reached a per-sample limit; its further calls are refused (429)."""

    def __init__(self, sample_key: str, limit: str, value: float) -> None:
        self.sample_key = sample_key
        self.limit = limit
        self.value = value
        super().__init__(f"sample {sample_key!r} reached {limit} ({value})")
