"""The one exception → skip mapping (`pinned_eval.skip_mapping`), for the flow and the external posture."""

from __future__ import annotations

import httpx
import pytest

from pinned_eval.external import EvalSkip
from pinned_eval.fleet.errors import (
    FleetError,
    FleetUnhealthy,
    GenerateRejected,
    GenerationAborted,
    NotPinned,
    WeightVersionMismatch,
)
from pinned_eval.gateway import AgentBudgetExceeded
from pinned_eval.skip_mapping import fleet_skips, skip_for
from pinned_eval.skips import EvalSkipped, SkipReason


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (WeightVersionMismatch("5", "4", []), "pin_violation"),
        (GenerateRejected("http://e", 503, "no workers"), "unhealthy"),
        (GenerationAborted("r1", 3, "aborted"), "unhealthy"),
        (FleetError("router gone"), "unhealthy"),
        (httpx.ConnectError("refused"), "unhealthy"),
        (FleetUnhealthy("engines down"), "unhealthy"),
        (EvalSkipped("quota", "over quota"), "quota"),
        (AgentBudgetExceeded("max_requests", 10), "agent_budget"),
        (EvalSkipped(SkipReason.AGENT_ERROR, "gsm8k sample 3: ValueError: boom"), "agent_error"),
    ],
)
def test_fleet_failures_are_typed_skips(exc: Exception, reason: str) -> None:
    mapped = skip_for(exc)
    assert mapped is not None and mapped[0] == reason
    with pytest.raises(EvalSkipped) as err, fleet_skips("fleet f1"):
        raise exc
    assert err.value.reason == reason and err.value.message.startswith(("fleet f1: ", mapped[1]))


@pytest.mark.parametrize(
    "exc", [GenerateRejected("http://e", 400, "bad schema"), ValueError("a bug"), KeyError("x")]
)
def test_bugs_are_not_skips(exc: Exception) -> None:
    assert skip_for(exc) is None
    with pytest.raises(type(exc)), fleet_skips("ctx"):
        raise exc


def test_the_external_posture_gets_its_contract_type() -> None:
    with pytest.raises(EvalSkip) as err, fleet_skips("http://srv", as_type=EvalSkip):
        raise WeightVersionMismatch("5", "4", [])
    assert err.value.reason == "pin_violation" and err.value.message.startswith("http://srv: ")
    assert isinstance(err.value.__cause__, WeightVersionMismatch)
    skip = EvalSkip("quota")
    with pytest.raises(EvalSkip) as same, fleet_skips(as_type=EvalSkip):
        raise skip
    assert same.value is skip
    assert skip_for(NotPinned("x")) == ("unhealthy", "x")
