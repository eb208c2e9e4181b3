"""An operation's cost follows what it returns, not the run's history: the number of API requests
the trainer's admission refresh and `status` make is the same for a run of a few points and for
one of more points than a page holds (counted through a recording httpx transport, not timed).

Real Prefect server (the session fixture); points are seeded over its REST API in final states.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import httpx
import pytest

from bench.history_seed import seed_points, server_time
from pinned_eval.events import BlockNames
from pinned_eval.settings import PrefectApiSettings
from tests.prefect_server import prefect_rest_client
from trainer_integration.admission import AdmissionView
from trainer_integration.admission_sync import AdmissionSync
from trainer_integration.export_target import ExportTarget
from trainer_integration.rest import PrefectRest, auth_headers

pytestmark = pytest.mark.e2e

BIG = 210  # more than one page of 200


class RecordingTransport(httpx.HTTPTransport):
    """Records (method, path) and the answer's size of every request it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.bytes = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = super().handle_request(request)
        resp.read()
        self.calls.append((request.method, request.url.path))
        self.bytes += len(resp.content)
        return resp

    def take(self) -> list[tuple[str, str]]:
        calls, self.calls, self.bytes = self.calls, [], 0
        return calls


def _wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def runs(prefect_server: str) -> dict[int, str]:
    """Two runs, each with its history (completed points) and one RUNNING point at step 10_000."""
    out = {}
    with prefect_rest_client(prefect_server) as http:
        for n in (3, BIG):
            run = f"hc{n}-{uuid.uuid4().hex[:6]}"
            seed_points(http, run, range(1, n + 1))
            seed_points(http, run, range(10_000, 10_001), "RUNNING")
            out[n] = run
        seeded = server_time(http)
        # the server's clock (whole seconds) past the last seeded end time: what ended before is history
        _wait_for(lambda: server_time(http) > seeded)
    return out


def _sync(api: str, run: str, transport: RecordingTransport) -> AdmissionSync:
    rest = PrefectRest(api, httpx.Client(transport=transport, headers=auth_headers(PrefectApiSettings()), timeout=30))
    return AdmissionSync(
        run, rest, AdmissionView(run, visible_timeout_s=30), ExportTarget(None, None), BlockNames(),
        spooled=set, enqueue=lambda e: None, poll_s=30, idle_sync_s=30, changed_margin_s=0,
    )  # fmt: skip


def test_the_admission_refresh_makes_one_request_whatever_the_history(
    prefect_server: str, runs: dict[int, str]
) -> None:
    filter_call = ("POST", "/api/flow_runs/filter")
    seen: dict[int, list[tuple[str, str]]] = {}
    answered: dict[int, int] = {}
    for n, run in runs.items():
        rec = RecordingTransport()
        sync = _sync(prefect_server, run, rec)
        assert sync.refresh() == {10_000}
        first = rec.take()  # the first refresh reads the whole history, paged: what exists is known
        assert first == [filter_call] * (n // 200 + 1)
        assert sync.view.steps() == set(range(1, n + 1)) | {10_000}
        assert sync.refresh() == {10_000}
        answered[n] = rec.bytes
        seen[n] = rec.take()
        assert sync.view.steps() == set(range(1, n + 1)) | {10_000}
    assert seen[3] == seen[BIG] == [filter_call]
    # the answer holds what is in flight on the server, not the history: the same size for both runs
    # (run names differ in length only by the digits of n)
    assert abs(answered[3] - answered[BIG]) < 200


def test_a_point_that_ends_or_appears_between_refreshes_is_seen_by_the_next(prefect_server: str) -> None:
    run = f"hc-late-{uuid.uuid4().hex[:6]}"
    rec = RecordingTransport()
    with prefect_rest_client(prefect_server) as http:
        seed_points(http, run, range(1, 3))
        sync = _sync(prefect_server, run, rec)
        assert sync.refresh() == set()
        seed_points(http, run, range(3, 4), "RUNNING")
        assert sync.refresh() == {3}
        by_name = {"flow_runs": {"name": {"any_": [f"{run}/step-3"]}}}
        run_3 = http.post("/flow_runs/filter", json=by_name).json()[0]["id"]
        done = {"state": {"type": "COMPLETED"}, "force": True}
        http.post(f"/flow_runs/{run_3}/set_state", json=done).raise_for_status()
        seed_points(http, run, range(4, 5))  # created and ended between two refreshes, never seen in flight
    rec.take()
    assert sync.refresh() == set()
    assert rec.take() == [("POST", "/api/flow_runs/filter")]
    assert sync.view.steps() == {1, 2, 3, 4}


def test_status_reads_the_same_requests_whatever_the_history(prefect_server: str, runs: dict[int, str]) -> None:
    from prefect import get_client

    from app.history import read_history

    seen: dict[int, list[tuple[str, str]]] = {}
    for n, run in runs.items():
        rec = RecordingTransport()
        with get_client(sync_client=True, httpx_settings={"transport": rec}) as client:
            history = read_history(run, client=client, last=50)
            seen[n] = [c for c in rec.take() if c != ("GET", "/api/csrf-token")]  # the client's own handshake
        # the window: the latest 50 steps (the RUNNING point at 10_000 included), states embedded
        assert [p.step for p in history.points] == [*range(max(1, n - 48), n + 1), 10_000]
        assert [p.outcome for p in history.points][-2:] == ["measured", "running"]
        with get_client(sync_client=True, httpx_settings={"transport": rec}) as client:
            since = read_history(run, client=client, since=n - 1)  # `status --since STEP`
            assert [c for c in rec.take() if c != ("GET", "/api/csrf-token")] == seen[n]
        assert [p.step for p in since.points] == [n - 1, n, 10_000]
    assert seen[3] == seen[BIG] == [("POST", "/api/flow_runs/filter"), ("POST", "/api/artifacts/latest/filter")]
