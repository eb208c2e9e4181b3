"""The one exception → skip mapping, used by the eval-point tasks and the external posture.

| exception                                                   | outcome                         |
|-------------------------------------------------------------|---------------------------------|
| an `EvalSkipped` (`PinViolation`, `FleetUnhealthy`, ...)    | that skip, its own reason       |
| `AgentBudgetExceeded` (a point gateway's budget used up)    | `agent_budget`                  |
| `EvalSkipped(SkipReason.AGENT_ERROR, ...)` (user code failed on a sample) | `agent_error`     |
| `WeightVersionMismatch` (a response from other weights)     | `pin_violation`                 |
| `GenerateRejected` with a 5xx status                        | `unhealthy`                     |
| `GenerateRejected` with a 4xx status (a malformed request)  | not a skip: a bug, it propagates|
| `GenerationAborted`, any other `FleetError`, `httpx.TransportError` | `unhealthy`             |
| `RemoteRewardError` (a scoring service gave no reward)     | `reward_unavailable`            |
| `RewardRefused` (miles' reward raises on a row)             | `reward_unavailable`            |
| anything else                                               | not a skip (the point crashes)  |

`fleet_skips(context, as_type=...)` applies it to a block of code: a mapped exception is re-raised
as `as_type(reason, "<context>: <message>")` chained to the original (`as_type` is `EvalSkipped`
for the flow's tasks, the backend contract's `EvalSkip` for an external backend).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from pinned_eval.fleet.errors import FleetError, GenerateRejected, WeightVersionMismatch
from pinned_eval.scoring.answers import RewardRefused
from pinned_eval.scoring.remote import RemoteRewardError
from pinned_eval.skips import EvalSkipped, SkipReason


def skip_for(exc: BaseException) -> tuple[str, str] | None:
    """(reason, message) of the skip `exc` stands for, or None when it is not a skip."""
    if isinstance(exc, EvalSkipped):
        return exc.reason, exc.message
    if isinstance(exc, RemoteRewardError | RewardRefused):
        return SkipReason.REWARD_UNAVAILABLE.value, str(exc)
    if isinstance(exc, WeightVersionMismatch):
        return SkipReason.PIN_VIOLATION.value, str(exc)
    if isinstance(exc, GenerateRejected) and exc.status_code < 500:
        return None
    if isinstance(exc, FleetError | httpx.TransportError):
        return SkipReason.UNHEALTHY.value, str(exc) or repr(exc)
    return None


@contextmanager
def fleet_skips(context: str = "", *, as_type: type[EvalSkipped] = EvalSkipped) -> Iterator[None]:
    """Re-raise what the block raises as the skip it stands for (see the table); the rest propagates."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, as_type):
            raise
        mapped = skip_for(exc)
        if mapped is None:
            raise
        reason, message = mapped
        raise as_type(reason, f"{context}: {message}" if context else message) from exc
