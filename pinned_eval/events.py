"""The `pinned-eval.point.requested` event: what the trainer sends to request an eval point.

The event id is uuid5(run, step), so sending the same point twice creates one flow run (the
server de-duplicates by id). The payload carries every flow parameter; the deployment trigger in
`prefect.yaml` maps them one to one. No Prefect import: trainers post it with plain httpx.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.points import EVENT_REQUESTED, PointRequest, point_event_id, run_resource_id
from pinned_eval.settings import PrefectApiSettings


class BlockNames(BaseModel):
    """Saved block documents a point uses."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    suite: str = Field(default="default", min_length=1)
    fleet: str = Field(default="default", min_length=1)
    staging: str = Field(default="default", min_length=1)
    sinks: str = Field(default="default", min_length=1)


def point_event(request: PointRequest, blocks: BlockNames | None = None) -> dict[str, Any]:
    """The event JSON for `POST /api/events` (a list of these) or a Prefect Cloud webhook body."""
    payload = request.model_dump(mode="json")
    payload["blocks"] = (blocks or BlockNames()).model_dump()
    return {
        "id": str(point_event_id(request.run, request.step)),
        "occurred": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "event": EVENT_REQUESTED,
        "resource": {"prefect.resource.id": run_resource_id(request.run), "pinned-eval.run": request.run},
        "payload": payload,
    }


def post_events(api_url: str, events: list[dict[str, Any]], *, client: httpx.Client | None = None) -> None:
    """POST events to an OSS Prefect server (`<api_url>/events`, 204 on success); without `client`,
    with the credential of the environment (`PrefectApiSettings`)."""
    http = client or httpx.Client(timeout=10, headers=PrefectApiSettings().auth_headers())
    try:
        resp = http.post(f"{api_url.rstrip('/')}/events", json=events)
        resp.raise_for_status()
    finally:
        if client is None:
            http.close()


# ---- outcome events (emitted by the eval-point flow; `tasks.alerts`) ---------------------------

EVENT_MEASURED = "pinned-eval.point.measured"
EVENT_SKIPPED = "pinned-eval.point.skipped"
EVENT_FAILED = "pinned-eval.point.failed"
EVENT_REGRESSED = "pinned-eval.point.regressed"
OUTCOME_EVENTS = (EVENT_MEASURED, EVENT_SKIPPED, EVENT_FAILED, EVENT_REGRESSED)
POINT_RESOURCE_PREFIX = "pinned-eval.point."


def point_resource(run: str, step: int, dataset: str | None = None) -> dict[str, str]:
    """The resource of an outcome event: one point (`pinned-eval.point.<run>.<step>`) or one
    dataset of it (`...<step>.<dataset>`), with the run, step and dataset as labels. Its id never
    matches the `pinned-eval.run.*` trigger of `point.requested`."""
    name = f"{run}/step-{step}" + (f"/{dataset}" if dataset else "")
    return {
        "prefect.resource.id": f"{POINT_RESOURCE_PREFIX}{run}.{step}" + (f".{dataset}" if dataset else ""),
        "prefect.resource.name": name,
        "pinned-eval.run": run,
        "pinned-eval.step": str(step),
        "pinned-eval.dataset": dataset or "",
    }
