"""A point's delegates, one after the other, each behind its own point gateway.

Contract of `DelegateRun(session, delegates, fallbacks, rollout_id, limits, prior_requests=).run()`:
- `prior_requests`: the model calls the point made before (its generation); the session's request
  count starts there, so `limits.max_requests` bounds the whole point, not the delegates alone;
- for each delegate (in config order, as miles calls them): start a `UrlTokenGateway` on the
  point's `session` (the pinned fleet: every call version-checked, `limits` the point's budget,
  every call recorded), post miles' request with `router_url` = that gateway's URL
  (`client.post`), stop the gateway (nothing of it stays listening; a call the delegate still makes
  is refused), then read the reply's `raw_metrics`;
- a reply of another weight version behind the gateway fails the run with the gateway's
  `violation` (`pin_violation`), a used-up budget with `agent_budget`, before any delegate
  failure; a delegate that fails, hangs past its deadline, answers garbage or a `raw_metrics` with
  no numeric metric (or over the client's bounds) is `DelegateFailed` (`delegate_failed`) naming it;
- `metrics`: miles' aggregation: each delegate's `raw_metrics` updates one dict (a later
  delegate's top-level key replaces an earlier one's), flattened by `client.flatten` into
  `eval/...` keys;
- `calls`: every gateway call of every delegate (`CallRecord` fields plus `delegate`), filled as
  each delegate ends, also when the run fails (the caller persists them); `replies`: each
  delegate's whole reply (miles only logs it).
This module imports no Prefect.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from pinned_eval.delegate.client import DelegateFailed, flatten, post, raw_metrics
from pinned_eval.delegate.config import DelegateSpec, request_body
from pinned_eval.delegate.gateway import UrlTokenGateway
from pinned_eval.gateway import GatewayLimits
from pinned_eval.rollout.session import PointSession

__all__ = ["CALL_COLUMNS", "DelegateRun", "delegate_limits"]

CALL_COLUMNS = ("delegate", "route", "sample_key", "status", "weight_version", "prompt_tokens",
                "completion_tokens", "latency_s", "error")


def delegate_limits(defaults: Any, fallbacks: Any) -> GatewayLimits:
    """The point budget a delegate's gateway enforces: `agent_max_requests` / `agent_max_tokens`
    of `eval.defaults`, else the suite's fallbacks (unset: unbounded)."""

    def pick(field: str) -> Any:
        value = getattr(defaults, field)
        return getattr(fallbacks, field) if value is None else value

    return GatewayLimits(max_requests=pick("agent_max_requests"), max_tokens=pick("agent_max_tokens"))


class DelegateRun:
    """The delegates of one point (see the module docstring)."""

    def __init__(
        self,
        session: PointSession,
        delegates: Sequence[DelegateSpec],
        fallbacks: Any,
        rollout_id: int,
        limits: GatewayLimits,
        *,
        prior_requests: int = 0,
    ) -> None:
        self.session = session
        session.counters.requests = max(session.counters.requests, prior_requests)
        self.delegates = list(delegates)
        self.fallbacks = fallbacks
        self.rollout_id = rollout_id
        self.limits = limits
        self.calls: list[dict[str, Any]] = []
        self.replies: dict[str, Any] = {}
        self.metrics: dict[str, float] = {}

    async def run(self) -> dict[str, float]:
        aggregated: dict[str, Any] = {}
        for spec in self.delegates:
            reply = await self._one(spec)
            metrics = raw_metrics(spec, reply)
            try:
                numeric = flatten(metrics)
            except ValueError as exc:
                raise DelegateFailed(spec, str(exc)) from None
            if not numeric:
                raise DelegateFailed(spec, "raw_metrics holds no numeric metric")
            aggregated.update(metrics)
        self.metrics = flatten(aggregated, bounded=False)
        return self.metrics

    async def _one(self, spec: DelegateSpec) -> Any:
        gateway = UrlTokenGateway(self.session, self.limits)
        failure: DelegateFailed | None = None
        reply: Any = None
        try:
            async with gateway:
                body = request_body(spec, self.fallbacks, self.rollout_id, gateway.router_url)
                try:
                    reply = await post(spec, body)
                except DelegateFailed as exc:
                    failure = exc
        finally:
            self.calls.extend({"delegate": spec.name, **asdict(record)} for record in gateway.calls)
        if gateway.violation is not None:  # the pin or the budget first: the delegate may fail because of it
            raise gateway.violation
        if failure is not None:
            raise failure
        self.replies[spec.name] = reply
        return reply
