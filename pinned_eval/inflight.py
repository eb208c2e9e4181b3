"""The one definition of a run's eval-point flow runs and of which are in flight (no Prefect import).

A run's points are the runs of the `eval-point` flow whose `run` parameter is the run (and that
carry a `step`) and that are either tagged `run:<run>` (the flow tags itself at start; trainer-side
skip records are created tagged) or not terminal yet: a triggered run carries only the
deployment's tags until it starts, and a started run may still be untagged for a moment, so an
untagged RUNNING run is in flight too. A point is in flight while its state type is not terminal.

`point_runs_filter(run)` is that query as the body of `POST /flow_runs/filter`; the trainer side
sends it over plain HTTP (`trainer_integration.rest`), the Prefect side validates it into
Prefect's filter models (`flows.point_runs`), so both read the same runs.

`steps_runs_filter(run, steps)` reads the points of a few steps: runs named after them or not
terminal (`is_step_point` then keeps those `point_runs_filter` selects); its answer follows the
steps asked for and what is in flight, never the run's history.

`changed_runs_filter(...)` is the trainer's incremental refresh: every point flow run that is not
terminal (of any run; `is_point_of` keeps this run's), that ended at or after `since` (server
time), or that is named after a step this process requested and has not seen yet. Its answer
follows what can be in flight or has just changed, never the run's history.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pinned_eval.points import flow_run_name

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


def changed_runs_filter(
    run: str, since: str, unseen: list[int], flow_name: str = POINT_FLOW
) -> dict[str, Any]:
    """`flows` and `flow_runs` filters selecting every point flow run that is not terminal, that
    ended at or after `since` (ISO time on the server's clock), or whose name is `<run>/step-<s>`
    for a step in `unseen`; `is_point_of` then matches the `run` parameter."""
    runs: dict[str, Any] = {
        "operator": "or_",
        "state": {"type": {"any_": list(NON_TERMINAL)}},
        "end_time": {"after_": since},
    }
    if unseen:
        runs["name"] = {"any_": [flow_run_name(run, s) for s in sorted(unseen)]}
    return {"flows": {"name": {"any_": [flow_name]}}, "flow_runs": runs}


def steps_runs_filter(run: str, steps: list[int], flow_name: str = POINT_FLOW) -> dict[str, Any]:
    """`flows` and `flow_runs` filters selecting every point flow run named `<run>/step-<s>` for a
    step in `steps` (the flow's run name) or not terminal (a triggered run keeps the deployment's
    generated name until it starts); `is_step_point` then keeps the points of `run` at `steps`."""
    return {
        "flows": {"name": {"any_": [flow_name]}},
        "flow_runs": {
            "operator": "or_",
            "name": {"any_": [flow_run_name(run, s) for s in sorted(steps)]},
            "state": {"type": {"any_": list(NON_TERMINAL)}},
        },
    }


def is_step_point(
    parameters: Mapping[str, Any] | None, tags: list[str] | None, state_type: str | None, run: str, steps: set[int]
) -> bool:
    """Whether a flow run is a point of `run` at one of `steps` that `point_runs_filter` selects
    (tagged `run:<run>`, or not terminal)."""
    return (
        is_point_of(parameters, run)
        and int(parameters["step"]) in steps  # type: ignore[index]
        and (f"run:{run}" in (tags or []) or in_flight(state_type))
    )
