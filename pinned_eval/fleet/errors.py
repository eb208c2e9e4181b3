"""Typed fleet errors.

`PinViolation` and `FleetUnhealthy` are `EvalSkipped` subclasses carrying the skip reasons
`pin_violation` and `unhealthy`, so an eval point that catches `EvalSkipped` records them as
attributable skips. Every other error here is a `FleetError` (a crash if it escapes a point).
"""

from __future__ import annotations

from pinned_eval.fleet.models import EngineCheck
from pinned_eval.skips import EvalSkipped, SkipReason


class FleetError(Exception):
    """Base of the fleet client's own failures that are not skips."""


class EngineHTTPError(FleetError):
    """An engine or the router answered a status the protocol does not allow here."""

    def __init__(self, url: str, status_code: int, body: str) -> None:
        self.url = url
        self.status_code = status_code
        self.body = body
        super().__init__(f"{url} answered HTTP {status_code}: {body[:500]}")


class GenerateRejected(EngineHTTPError):
    """`/generate` refused the request (400 schema error, 422 router parse error, 503 no workers...)."""


class GenerationAborted(FleetError):
    """Every try of one request came back with `finish_reason.type == "abort"`."""

    def __init__(self, rid: str | None, attempts: int, message: str) -> None:
        self.rid = rid
        self.attempts = attempts
        super().__init__(f"request {rid or '<no rid>'} aborted {attempts} times: {message}")


class WeightVersionMismatch(FleetError):
    """A response was generated (in part) by weights other than the pinned version."""

    def __init__(self, expected: str, got: str | None, spans: list[str]) -> None:
        self.expected = expected
        self.got = got
        self.spans = spans
        extra = f" (spans {spans})" if spans else ""
        super().__init__(f"response carries weight_version {got!r}, expected {expected!r}{extra}")


class NotPinned(FleetError):
    """`generate` was called with no expected version and no successful pin to take it from."""


class RouterError(FleetError):
    """The router did not reach the asked-for membership or readiness in time."""


class PinViolation(EvalSkipped):
    """After every attempt some engine did not load, or reads back another version or path."""

    def __init__(self, weight_version: str, snapshot_path: str, checks: list[EngineCheck], attempts: int) -> None:
        self.weight_version = weight_version
        self.snapshot_path = snapshot_path
        self.checks = checks
        self.attempts = attempts
        bad = "; ".join(f"{c.url}: {c.problem}" for c in checks if not c.ok)
        super().__init__(
            SkipReason.PIN_VIOLATION,
            f"version {weight_version!r} from {snapshot_path} not verified after {attempts} attempts: {bad}",
        )


class FleetUnhealthy(EvalSkipped):
    """Engines are down and cannot be revived, or the router never became ready."""

    def __init__(self, message: str, urls: list[str] | None = None) -> None:
        self.urls = urls or []
        super().__init__(SkipReason.UNHEALTHY, message)
