"""The point gateway: the only model address user code of an agentic point sees (docs/agentic.md).

`PointGateway` serves an HTTP face on the point's `PointSession`; `GatewayLimits` is its budget.
The session never imports this package. This package imports no Prefect.
"""

from pinned_eval.gateway.limits import AgentBudgetExceeded, GatewayLimits, SampleLimitExceeded
from pinned_eval.gateway.records import CallRecord
from pinned_eval.gateway.server import MAX_BODY, PointGateway

__all__ = ["MAX_BODY", "AgentBudgetExceeded", "CallRecord", "GatewayLimits", "PointGateway", "SampleLimitExceeded"]
