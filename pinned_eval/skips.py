"""Typed skip reasons: every eval point that does not measure says why, at its step.

Contract: tasks raise `EvalSkipped(SkipReason.X, message)`; the eval-point flow catches exactly
that type, records `eval/skipped_<reason>: 1` at the step in every sink and ends the run in a
Completed state named "Skipped". External backends may raise custom reasons (any slug string);
`skip_reason()` normalises them. This module imports nothing heavy (no Prefect, no torch).
"""

from __future__ import annotations

import re
from enum import StrEnum

_SLUG = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


class SkipReason(StrEnum):
    BUSY = "busy"
    EXPORT_FAILED = "export_failed"
    EXPORT_BUSY = "export_busy"  # an in-loop export while the previous snapshot was still being written
    CKPT_MISSING = "ckpt_missing"
    UNHEALTHY = "unhealthy"
    PIN_VIOLATION = "pin_violation"
    REWARD_UNAVAILABLE = "reward_unavailable"  # the remote scoring service gave no reward
    TIMED_OUT = "timed_out"  # the point ran past the suite block's point_timeout_seconds
    CRASHED = "crashed"
    AGENT_BUDGET = "agent_budget"  # an agentic point used up its model-call budget (requests, tokens)
    AGENT_ERROR = "agent_error"  # user generate/agent code failed (exception, hang, memory) on a sample
    HARNESS_ERROR = "harness_error"  # an external harness (lm-eval) failed: unknown task, error, no result
    DELEGATE_FAILED = "delegate_failed"  # an eval.delegate service failed, hung past its deadline or answered garbage


def skip_reason(value: str | SkipReason) -> str:
    """Return the canonical reason string; custom reasons must be lowercase slugs."""
    if isinstance(value, SkipReason):
        return value.value
    if not _SLUG.match(value):
        raise ValueError(f"skip reason must be a lowercase slug like 'quota', got {value!r}")
    return value


def skip_metric(reason: str | SkipReason) -> str:
    """The metric key a skip is logged under, e.g. `eval/skipped_busy`."""
    return f"eval/skipped_{skip_reason(reason)}"


class EvalSkipped(Exception):
    """An attributable non-result at a step. `reason` is a SkipReason value or a custom slug."""

    def __init__(self, reason: str | SkipReason, message: str = "") -> None:
        self.reason = skip_reason(reason)
        self.message = message or self.reason
        super().__init__(f"{self.reason}: {self.message}")
