"""Seed a Prefect server with a run's eval-point history through its REST API (used by
`bench/history.py` and the history-cost tests).

Each point is one `eval-point` flow run named `<run>/step-<step>`, tagged `run:<run>`, created
directly in its final state (`POST /flow_runs/` with a state), a few requests at a time (a busy
SQLite server's 503 is sent again).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from pinned_eval.inflight import POINT_FLOW
from pinned_eval.points import flow_run_name


def point_flow_id(http: httpx.Client) -> str:
    """The id of the `eval-point` flow (created if missing; `POST /flows/` is an upsert)."""
    resp = http.post("/flows/", json={"name": POINT_FLOW})
    resp.raise_for_status()
    return str(resp.json()["id"])


def seed_point(
    http: httpx.Client, flow_id: str, run: str, step: int, state: str = "COMPLETED",
    parameters: dict[str, Any] | None = None,
) -> str:
    """One point of `run` at `step` in `state` (type; named as Prefect names it), with `parameters`
    besides `run` and `step` (e.g. its `sinks` block); its flow run id."""
    body = {
        "flow_id": flow_id,
        "name": flow_run_name(run, step),
        "parameters": {**(parameters or {}), "run": run, "step": step},
        "tags": [f"run:{run}"],
        "state": {"type": state, "name": state.title(), "message": f"seeded {state.lower()}"},
    }
    deadline = time.monotonic() + 60
    while True:
        resp = http.post("/flow_runs/", json=body)
        if resp.status_code != 503 or time.monotonic() > deadline:  # 503: SQLite busy, try again
            break
        time.sleep(0.1)
    resp.raise_for_status()
    return str(resp.json()["id"])


def seed_points(
    http: httpx.Client, run: str, steps: range, state: str = "COMPLETED", *, workers: int = 4,
    parameters: dict[str, Any] | None = None,
) -> None:
    """Points of `run` at every step of `steps`, all in `state`, created `workers` at a time in
    step order (as a trainer creates them: out of order by at most `workers` steps)."""
    flow_id = point_flow_id(http)
    with ThreadPoolExecutor(workers) as pool:
        for i in range(0, len(steps), workers):
            list(pool.map(lambda s: seed_point(http, flow_id, run, s, state, parameters), steps[i : i + workers]))


def server_time(http: httpx.Client) -> datetime:
    """The server's clock (its `Date` header, whole seconds)."""
    resp = http.get("/health")
    resp.raise_for_status()
    return parsedate_to_datetime(resp.headers["date"])
