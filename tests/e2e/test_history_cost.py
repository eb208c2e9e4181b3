"""An operation's cost follows what it returns, not the run's history: the number of API requests
the trainer's admission refresh, `status`, `best` (the CLI's and the trainer's), `rerun`'s lookup,
the janitor's sweep read, the trainer's `wait_for` and the miles adapter make is the same for a
run of a few points and for one of more points than a page holds (counted through a recording
httpx transport, not timed).

Real Prefect server (the session fixture); points are seeded over its REST API in final states, one
history per module (`scored`) that every test reads.
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
from trainer_integration.events import SINKS_BLOCK_SLUG
from trainer_integration.export_target import ExportTarget
from trainer_integration.miles_adapter import AdapterConfig, PinnedEvalREST
from trainer_integration.outcomes import PointOutcomes
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
def runs(scored: dict[int, tuple[str, str]]) -> dict[int, str]:
    """The runs of `scored` (one history seeded per module, for every test): {n: run}."""
    return {n: run for n, (run, _) in scored.items()}


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
        assert first == [filter_call] * ((n + 4) // 200 + 1)  # n + 3 flow runs
        assert sync.view.steps() == set(range(1, n + 2)) | {10_000}
        assert sync.refresh() == {10_000}
        answered[n] = rec.bytes
        seen[n] = rec.take()
        assert sync.view.steps() == set(range(1, n + 2)) | {10_000}
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
        assert [p.step for p in history.points] == [*range(max(1, n - 47), n + 2), 10_000]
        assert [p.outcome for p in history.points][-4:] == ["measured", "failed", "measured", "running"]
        with get_client(sync_client=True, httpx_settings={"transport": rec}) as client:
            since = read_history(run, client=client, since=n - 1)  # `status --since STEP`
            assert [c for c in rec.take() if c != ("GET", "/api/csrf-token")] == seen[n]
        assert [p.step for p in since.points] == [n - 1, n, n + 1, 10_000]
    assert seen[3] == seen[BIG] == [("POST", "/api/flow_runs/filter"), ("POST", "/api/artifacts/latest/filter")]


# ---- best, rerun, the janitor's sweep, the trainer's outcomes, the miles adapter ----------------


def _score(step: int) -> float:
    return step / 1000  # step n scores best; its rerun failed, so the one before it wins (n + 1 has no row)


@pytest.fixture(scope="module")
def scored(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[str, str]]:
    """Two runs (3 and BIG measured points, sinks block with a JSONL ledger); step n's rerun (a
    second flow run) FAILED; step n + 1 completed under the `default` sinks block (no ledger: what
    `status` reads from its artifacts); one RUNNING point at step 10_000; returned once the server's
    clock is past the last seeded end time (what ended before is history). {n: (run, sinks block)}."""
    from blocks import SinksBlock
    from pinned_eval.sinks import Ledger, MetricRow

    ledger = Ledger(tmp_path_factory.mktemp("hc-ledger") / "metrics.jsonl")
    sinks = f"hc-sinks-{uuid.uuid4().hex[:6]}"
    SinksBlock(jsonl_path=str(ledger.path)).save(sinks)
    out = {}
    with prefect_rest_client(prefect_server) as http:
        for n in (3, BIG):
            run = f"hcs{n}-{uuid.uuid4().hex[:6]}"
            seed_points(http, run, range(1, n + 1), parameters={"sinks": sinks})
            seed_points(http, run, range(n, n + 1), "FAILED", parameters={"sinks": sinks})
            seed_points(http, run, range(n + 1, n + 2))  # the `default` sinks block: no ledger
            seed_points(http, run, range(10_000, 10_001), "RUNNING", parameters={"sinks": sinks})
            ledger.write_point([
                MetricRow(run=run, step=s, dataset="arith", state="measured", weight_version=str(s),
                          metrics={"eval/arith": _score(s)})
                for s in range(1, n + 1)
            ])  # fmt: skip
            out[n] = (run, sinks)
        seeded = server_time(http)
        _wait_for(lambda: server_time(http) > seeded)  # the server's clock has whole seconds
    return out


def _api_calls(rec: RecordingTransport) -> list[tuple[str, str]]:
    return [c for c in rec.take() if c != ("GET", "/api/csrf-token")]  # the client's own handshake


def test_best_reads_two_requests_whatever_the_history(prefect_server: str, scored: dict[int, tuple[str, str]]) -> None:
    from prefect import get_client

    from app.commands.best import best_from_ledger

    seen = {}
    for n, (run, _) in scored.items():
        rec = RecordingTransport()
        with get_client(sync_client=True, httpx_settings={"transport": rec}) as client:
            found = best_from_ledger(client, run, "arith", 1.0)
            assert found and (found[0], found[1].step, found[1].outcome) == (_score(n - 1), n - 1, "measured")
            seen[n] = _api_calls(rec)
            lowest = best_from_ledger(client, run, "arith", -1.0)
            assert lowest and (lowest[0], lowest[1].step) == (_score(1), 1)
            assert _api_calls(rec) == seen[n]
            assert best_from_ledger(client, run, "nope", 1.0) is False
    # the newest point's sinks block, then the best candidates' flow runs (one page)
    assert seen[3] == seen[BIG] == [("POST", "/api/flow_runs/filter")] * 2


def test_reruns_lookup_reads_one_request_whatever_the_history(
    prefect_server: str, scored: dict[int, tuple[str, str]]
) -> None:
    from prefect import get_client

    from app.commands.points import step_runs, untagged_runs
    from flows.point_runs import step_point_flow_runs

    seen = {}
    for n, (run, _) in scored.items():
        rec = RecordingTransport()
        with get_client(sync_client=True, httpx_settings={"transport": rec}) as client:
            runs = step_runs(client, run, n)
            assert [(r.step, r.state_type) for r in runs] == [(n, "COMPLETED"), (n, "FAILED")]
            assert untagged_runs(client, run, n) == []
            seen[n] = _api_calls(rec)
            # the janitor's sweep reads the flow runs of its unretired snapshots' steps the same way
            swept = step_point_flow_runs(client, run, {1, n, 10_000})
            assert sorted((int(fr.parameters["step"]), fr.state.type.value) for fr in swept if fr.state) == [
                (1, "COMPLETED"), (n, "COMPLETED"), (n, "FAILED"), (10_000, "RUNNING")
            ]  # fmt: skip
            assert _api_calls(rec) == [("POST", "/api/flow_runs/filter")]
    assert seen[3] == seen[BIG] == [("POST", "/api/flow_runs/filter")] * 2


class _Outcomes(PointOutcomes):
    def __init__(self, run: str, rest: PrefectRest, sinks: str) -> None:
        self.run, self.rest, self.blocks, self.poll_s = run, rest, BlockNames(sinks=sinks), 0.05
        self.admission = AdmissionView(run, visible_timeout_s=30)


def test_the_trainers_best_and_wait_for_read_the_same_requests_whatever_the_history(
    prefect_server: str, scored: dict[int, tuple[str, str]]
) -> None:
    seen = {}
    for n, (run, sinks) in scored.items():
        rec = RecordingTransport()
        rest = PrefectRest(prefect_server, httpx.Client(transport=rec, headers=auth_headers(PrefectApiSettings())))
        outcomes = _Outcomes(run, rest, sinks)
        best = outcomes.best("eval/arith")
        assert best is not None and (best.step, best.state, best.metrics) == (
            n - 1, "measured", {"arith": {"eval/arith": _score(n - 1)}}
        )  # fmt: skip
        seen[n] = rec.take()
        done = outcomes.wait_for(n, timeout=5)
        assert (done.step, done.state, done.flow_runs) == (n, "failed", 2)
        assert rec.take() == seen[n]
    # the sinks block (for the ledger's path), then the candidates' (the step's) flow runs
    block = ("GET", f"/api/block_types/slug/{SINKS_BLOCK_SLUG}/block_documents/name/{scored[3][1]}")
    assert seen[3] == seen[BIG] == [block, ("POST", "/api/flow_runs/filter")]


class AsyncRecording(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.method, request.url.path))
        return await super().handle_async_request(request)


async def _collect(config: AdapterConfig, rec: AsyncRecording, flow_run_id: str) -> None:
    """What the adapter reads of a finished point: its flow run, then its samples artifact."""
    async with httpx.AsyncClient(transport=rec) as client:
        rest = PinnedEvalREST(config, client)
        outcome = await rest.wait(flow_run_id)
        assert (outcome.state_type, outcome.flow_run_id) == ("COMPLETED", flow_run_id)
        assert await rest.artifact_data(flow_run_id, f"eval-{config.run}-samples") is None


def test_the_miles_adapter_reads_the_same_requests_whatever_the_history(
    prefect_server: str, scored: dict[int, tuple[str, str]]
) -> None:
    import asyncio

    seen = {}
    with prefect_rest_client(prefect_server) as http:
        for n, (run, _) in scored.items():
            by_name = {"flow_runs": {"name": {"any_": [f"{run}/step-{n - 1}"]}}}
            flow_run_id = http.post("/flow_runs/filter", json=by_name).json()[0]["id"]
            config = AdapterConfig(api_url=prefect_server, run=run,
                                   auth_string=PrefectApiSettings().api_auth_string)  # fmt: skip
            rec = AsyncRecording()

            asyncio.run(_collect(config, rec, flow_run_id))
            # the point's own flow run, then its artifact by (flow run, key): never the run's history
            own = ("GET", f"/api/flow_runs/{flow_run_id}")
            seen[n] = [("GET", "/api/flow_runs/ID") if c == own else c for c in rec.calls]
    assert seen[3] == seen[BIG] == [("GET", "/api/flow_runs/ID"), ("POST", "/api/artifacts/filter")]
