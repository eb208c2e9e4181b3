"""`miles.rollout.base_types` as pinned-eval serves it: the new-form generate contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pinned_eval.agentic.compat.types import Sample

__all__ = ["GenerateFnInput", "GenerateFnOutput"]


@dataclass(frozen=True)
class GenerateFnInput:
    """What a new-form `async def generate(input)` receives; `args` is `state.args`."""

    state: Any
    sample: Sample
    sampling_params: dict[str, Any]
    evaluation: bool

    @property
    def args(self) -> Any:
        return self.state.args


@dataclass(frozen=True)
class GenerateFnOutput:
    """What it returns: one sample, or several (multi-agent, branches)."""

    samples: Sample | list[Sample]
