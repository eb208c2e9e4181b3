"""miles' `samples` list of an eval point, so miles' `--save-debug-rollout-data` (and any custom
eval log function reading `data[ds]["samples"]`) works on pinned-eval's results.

Contract: `miles_samples(result)` gives one sample per response, prompt-major (the order of
`result`'s lists), each with `index`, `reward`, `response_length`, `status` (`truncated` when
the response hit `max_new_tokens`, else `completed`) and `weight_versions` (`[version]`). Where
miles is installed these are miles' own `Sample` objects (built with its defaults, then these
fields set); without miles, `DebugSample` look-alikes with `to_dict()`. The response text and
prompt are not part of a point's recorded results, so they stay miles' defaults (empty).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pinned_eval.external import DatasetResult

try:  # pragma: no cover - only where miles is installed
    from miles.utils.types import Sample as _MilesSample
except ImportError:
    _MilesSample = None


@dataclass
class DebugSample:
    """The fields of miles' `Sample` a pinned-eval point knows (look-alike without miles)."""

    index: int
    reward: float | None
    response_length: int
    status: str
    weight_versions: list[str] = field(default_factory=list)
    prompt: str = ""
    response: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def miles_samples(result: DatasetResult) -> list[Any]:
    """One miles sample per response of `result` (see the module docstring)."""
    out: list[Any] = []
    for i, (reward, truncated, version, length) in enumerate(
        zip(result.rewards, result.truncated, result.weight_versions, result.response_lens, strict=True)
    ):
        debug = DebugSample(
            index=i,
            reward=reward,
            response_length=length,
            status="truncated" if truncated else "completed",
            weight_versions=[] if version is None else [version],
        )
        if _MilesSample is None:
            out.append(debug)
            continue
        fields: dict[str, Any] = {k: v for k, v in debug.to_dict().items() if k not in ("prompt", "response")}
        sample = _MilesSample()  # pragma: no cover - only where miles is installed
        status_enum = getattr(_MilesSample, "Status", None)
        for key, value in fields.items():
            if key == "status" and status_enum is not None:
                value = status_enum.TRUNCATED if truncated else status_enum.COMPLETED
            setattr(sample, key, value)
        out.append(sample)
    return out
