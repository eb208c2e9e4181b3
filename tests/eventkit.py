"""Outcome events as the test Prefect server stored them, counted only once everything emitted
before has landed (a sentinel event from this process, sent after draining its events worker)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from prefect import get_client
from prefect.events import emit_event
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
from prefect.events.worker import EventsWorker

from pinned_eval.polling import poll_until

SENTINEL = "pinned-eval.test.sentinel"


def stored_events(name: str, resource_id: str) -> list[dict[str, Any]]:
    """Every stored event `name` of resource `resource_id` (exact id), oldest first."""
    with get_client(sync_client=True) as client:
        page = client.read_events(
            EventFilter(
                occurred=EventOccurredFilter.model_validate({"since": datetime(2020, 1, 1, tzinfo=UTC)}),
                event=EventNameFilter(name=[name]),
                resource=EventResourceFilter(id=[resource_id]),
            ),
            limit=50,
        )
    return sorted((e.model_dump(mode="json") for e in page.events), key=lambda e: e["occurred"])


def settled_events(name: str, resource_id: str, at_least: int = 1) -> list[dict[str, Any]]:
    """`stored_events` once at least `at_least` are stored and every event this process emitted
    before the call is stored too (a duplicate still on its way would otherwise be missed)."""
    EventsWorker.drain_all(timeout=30)
    tag = f"pinned-eval.test.{uuid.uuid4().hex}"
    emit_event(SENTINEL, resource={"prefect.resource.id": tag})
    EventsWorker.drain_all(timeout=30)
    poll_until(lambda: stored_events(SENTINEL, tag), timeout_s=60, interval_s=0.5, what="the sentinel event")
    return poll_until(
        lambda: found if len(found := stored_events(name, resource_id)) >= at_least else None,
        timeout_s=60, interval_s=0.5, what=f"{at_least} {name} event(s) of {resource_id}",
    )


def related_flow_runs(event: dict[str, Any]) -> list[str]:
    return [r["prefect.resource.id"] for r in event["related"] if r.get("prefect.resource.role") == "flow-run"]
