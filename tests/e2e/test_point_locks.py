"""Consecutive eval points on one fleet: every slot is granted at its first request, and released
before the point returns (`tasks.admission`: the in-flight slot, and the fleet lock under which
one point pins and measures on a fleet at a time).

What a slow second point would look like if the previous point's fleet lock or in-flight slot
were released lazily: its request for the slot refused with a 423 and repeated after the
`Retry-After`. The requests counted are the Prefect client's `increment_concurrency_slots_with_lease`
calls (one per try of the slot service). A 503 that the SQLite server answers when the increment
loses a write race with its own event services is retried inside that call by Prefect's HTTP
client (docs/BENCHMARKS.md, "Point latency"), so it does not change these counts.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock
from uuid import UUID

import httpx
import pytest
from prefect import get_client
from prefect.client.orchestration import PrefectClient
from prefect.settings import PREFECT_API_URL, temporary_settings

from blocks import FleetBlock
from flows.eval_point import eval_point
from pinned_eval.points import inflight_limit_name
from tasks.admission import exclusive
from tests.pointkit import CpuFleet, save_point_blocks
from tests.reliability.netfaults import FaultyHTTPProxy, Rule

pytestmark = pytest.mark.e2e


@contextmanager
def slot_calls() -> Iterator[list[tuple[str, tuple[str, ...]]]]:
    """Every slot request and release made in this process: ("granted" | "refused <status>" |
    "released", limit names), in the order they were answered."""
    log: list[tuple[str, tuple[str, ...]]] = []
    leases: dict[UUID, tuple[str, ...]] = {}
    lock = threading.Lock()
    increment = PrefectClient.increment_concurrency_slots_with_lease
    release = PrefectClient.release_concurrency_slots_with_lease

    async def incrementing(self: PrefectClient, names: list[str], *args: Any, **kwargs: Any) -> httpx.Response:
        try:
            response = await increment(self, names, *args, **kwargs)
        except httpx.HTTPStatusError as exc:
            with lock:
                log.append((f"refused {exc.response.status_code}", tuple(names)))
            raise
        with lock:
            leases[UUID(response.json()["lease_id"])] = tuple(names)
            log.append(("granted", tuple(names)))
        return response

    async def releasing(self: PrefectClient, lease_id: UUID) -> httpx.Response:
        response = await release(self, lease_id)
        with lock:
            log.append(("released", leases.get(lease_id, ("?",))))
        return response

    with (
        mock.patch.object(PrefectClient, "increment_concurrency_slots_with_lease", incrementing),
        mock.patch.object(PrefectClient, "release_concurrency_slots_with_lease", releasing),
    ):
        yield log


def test_consecutive_points_get_each_slot_at_the_first_request_and_release_both_before_returning(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path
) -> None:
    fleet = FleetBlock(name=f"locks{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, keep_snapshots=0)
    source = {"kind": "hf", "path": str(tiny_model), "require_marker": False}
    inflight, fleet_lock = (inflight_limit_name(env.run),), (fleet.lock_name,)
    per_point = []
    for step in (1, 2):
        with slot_calls() as log:
            state = eval_point(**env.params(step, source=source), return_state=True)
        assert state.name == "Completed", state.message
        per_point.append(log)
    expected = [("granted", inflight), ("granted", fleet_lock), ("released", fleet_lock), ("released", inflight)]
    assert per_point == [expected, expected]
    with get_client(sync_client=True) as c:
        assert [c.read_global_concurrency_limit_by_name(n[0]).active_slots for n in (inflight, fleet_lock)] == [0, 0]


def test_a_503_while_acquiring_is_retried_by_prefects_client_inside_one_slot_request(prefect_server: str) -> None:
    """What a point meets when the SQLite server's increment loses its write race: the 503 is
    retried by Prefect's HTTP client (after ~2 s), the slot is granted at the second try, and the
    slot service made one request."""
    name = f"fleet-busy-{uuid.uuid4().hex[:8]}"  # a new name: a slot service of its own, through the proxy
    proxy = FaultyHTTPProxy(
        prefect_server.removesuffix("/api"),
        [Rule("error", methods=("POST",), path_contains="increment-with-lease", times=1, status=503)],
    )
    try:
        with slot_calls() as log, temporary_settings({PREFECT_API_URL: f"{proxy.url}/api"}), exclusive(name):
            pass
    finally:
        proxy.close()
    assert [s.action for s in proxy.requests if "increment-with-lease" in s.path] == ["error", "pass"]
    assert log == [("granted", (name,)), ("released", (name,))]
