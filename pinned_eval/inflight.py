"""The one definition of a run's eval-point flow runs and of which are in flight (no Prefect import).

A run's points are the runs of the `eval-point` flow whose `run` parameter is the run (and that
carry a `step`) and that are either tagged `run:<run>` (the flow tags itself at start; trainer-side
skip records are created tagged) or not terminal yet: a triggered run carries only the
deployment's tags until it starts, and a started run may still be untagged for a moment, so an
untagged RUNNING run is in flight too. A point is in flight while its state type is not terminal.

`point_runs_filter(run)` is that query as the body of `POST /flow_runs/filter`; the trainer side
sends it over plain HTTP (`trainer_integration.rest`), the Prefect side validates it into
Prefect's filter models (`flows.point_runs`), so both read the same runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

POINT_FLOW = "eval-point"
TERMINAL = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})
NON_TERMINAL = ("SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING")
RETRYABLE = frozenset({"FAILED", "CRASHED", "CANCELLED"})


def point_runs_filter(run: str, flow_name: str = POINT_FLOW) -> dict[str, Any]:
    """`flows` and `flow_runs` filters selecting every flow run that may be a point of `run`
    (tagged, or not terminal); `is_point_of` then matches the `run` parameter."""
    return {
        "flows": {"name": {"any_": [flow_name]}},
        "flow_runs": {
            "operator": "or_",
            "tags": {"all_": [f"run:{run}"]},
            "state": {"type": {"any_": list(NON_TERMINAL)}},
        },
    }


def is_point_of(parameters: Mapping[str, Any] | None, run: str) -> bool:
    """Whether a flow run with these parameters is a point of `run`."""
    return parameters is not None and parameters.get("run") == run and "step" in parameters


def in_flight(state_type: str | None) -> bool:
    """A point is in flight until its state is terminal (no state yet: scheduled, in flight)."""
    return state_type not in TERMINAL
