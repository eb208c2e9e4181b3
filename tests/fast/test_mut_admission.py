"""The trainer-side admission (trainer_integration/admission.py, admission_sync.py), decision by decision.

The view is fed the server's answers by hand (`refresh`), as the admission thread does; the thread
itself queries a real `POST /flow_runs/filter` on 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest

import trainer_integration.admission as admission_mod
from pinned_eval.events import BlockNames
from pinned_eval.points import PointRequest, SnapshotSource
from trainer_integration.admission import AdmissionView
from trainer_integration.admission_sync import AdmissionSync
from trainer_integration.events import event_entry, run_request_entry, skip_record_entry
from trainer_integration.export_target import ExportTarget
from trainer_integration.rest import PointRun, PrefectRest
from trainer_integration.spool import SpoolEntry

BLOCKS = BlockNames()


def _request(step: int) -> PointRequest:
    source = SnapshotSource(kind="hf", path=f"/ckpt/{step}", require_marker=False)
    return PointRequest(run="exp", step=step, source=source)


def _run(step: int, state: str) -> PointRun:
    return PointRun(
        id=f"id{step}",
        name=f"exp-{step}",
        step=step,
        state_type=state,
        state_name=state.title(),
        message=None,
        created="2026-01-01T00:00:00Z",
    )


def _decide(
    view: AdmissionView,
    step: int,
    *,
    policy: str = "skip",
    final: bool = False,
    max_in_flight: int = 1,
    spooled: set[int] | None = None,
    wake=lambda: None,
    poll_s: float = 0.01,
):
    return view.decide(
        step,
        final=final,
        policy=policy,
        max_in_flight=max_in_flight,
        spooled=lambda: set(spooled or ()),
        poll_s=poll_s,
        wake=wake,
    )


def test_a_view_without_an_answer_admits_offline() -> None:
    view = AdmissionView("exp", visible_timeout_s=60)
    assert view.fresh is False and view.active() is False and view.steps() == set()
    view.note(event_entry(_request(1), BLOCKS))
    assert _decide(view, 2) == ("ok", 1, 0.0, True)
    assert view.wait_fresh(0.0) is False


def test_at_the_bound_skip_is_busy_and_below_it_ok() -> None:
    view = AdmissionView("exp", visible_timeout_s=60)
    busy, fallback = view.refresh([_run(1, "RUNNING"), _run(2, "COMPLETED")], set())
    assert (busy, fallback) == ({1}, [])
    assert view.fresh is True and view.wait_fresh(0.0) is True
    assert _decide(view, 3, max_in_flight=1) == ("busy", 1, 0.0, False)
    assert _decide(view, 3, max_in_flight=2) == ("ok", 1, 0.0, False)
    view.stale()
    assert view.fresh is False
    assert _decide(view, 3, max_in_flight=1) == ("ok", 1, 0.0, True)


@pytest.mark.parametrize("kind", ["event", "run_request", "skip_record", "seen", "server"])
def test_a_step_already_requested_recorded_or_seen_exists(kind: str) -> None:
    view = AdmissionView("exp", visible_timeout_s=60)
    view.refresh([_run(9, "RUNNING")], set())
    if kind == "event":
        view.note(event_entry(_request(4), BLOCKS))
    elif kind == "run_request":
        view.note(run_request_entry(_request(4), BLOCKS))
    elif kind == "skip_record":
        view.note(skip_record_entry(_request(4), BLOCKS, "busy", "full"))
    elif kind == "seen":
        view.seen({4})
    else:
        view.refresh([_run(9, "RUNNING"), _run(4, "COMPLETED")], set())
    assert view.steps() == {4, 9}
    assert _decide(view, 4, max_in_flight=1) == ("exists", 1, 0.0, False)


def test_a_skip_record_is_never_in_flight_but_a_request_is() -> None:
    view = AdmissionView("exp", visible_timeout_s=60)
    view.note(skip_record_entry(_request(1), BLOCKS, "busy", "full"))
    assert view.refresh([], set()) == (set(), [])
    assert view.active() is False
    view.note(event_entry(_request(2), BLOCKS))
    assert view.active() is True
    assert view.refresh([], set()) == ({2}, [])
    assert _decide(view, 3, max_in_flight=1) == ("busy", 1, 0.0, False)
    assert view.refresh([_run(2, "COMPLETED")], set()) == (set(), [])
    assert view.active() is False
    assert view.refresh([_run(2, "RUNNING")], set()) == ({2}, [])
    assert view.active() is True


def test_the_final_point_waits_for_a_refresh_that_frees_a_slot() -> None:
    view = AdmissionView("exp", visible_timeout_s=60)
    view.refresh([_run(1, "RUNNING")], set())
    woken = threading.Event()
    order: list[str] = []

    def server() -> None:
        woken.wait(30)
        order.append("freed")
        view.refresh([_run(1, "COMPLETED")], set())

    thread = threading.Thread(target=server)
    thread.start()
    verdict, others, waited, offline = _decide(view, 2, final=True, wake=woken.set, poll_s=30)
    order.append("admitted")
    thread.join(30)
    assert (verdict, others, offline, order) == ("ok", 0, False, ["freed", "admitted"])
    assert waited > 0


def test_backpressure_waits_and_skip_does_not() -> None:
    view = AdmissionView("exp", visible_timeout_s=60)
    view.refresh([_run(1, "RUNNING")], set())
    wakes: list[int] = []

    def wake() -> None:
        wakes.append(1)
        threading.Thread(target=view.refresh, args=([_run(1, "FAILED")], set())).start()

    assert _decide(view, 2, policy="backpressure", wake=wake, poll_s=30)[:2] == ("ok", 0)
    assert len(wakes) == 1
    view.refresh([_run(2, "RUNNING")], set())
    assert _decide(view, 3, policy="skip", wake=wake) == ("busy", 1, 0.0, False)
    assert len(wakes) == 1


class _Clock:
    """The admission module's `time`: advanced only by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_the_seconds_waited_add_up_over_every_wait(monkeypatch) -> None:
    """Two waits (a refresh that leaves the slot full, then one that frees it): `waited` is the sum
    of both, read from the module's clock, which only `wake` advances (2.5 s, then 4 s)."""
    clock = _Clock()
    monkeypatch.setattr(admission_mod, "time", SimpleNamespace(monotonic=clock.monotonic))
    view = AdmissionView("exp", visible_timeout_s=60)
    view.refresh([_run(1, "RUNNING")], set())
    answers = iter([([_run(1, "RUNNING")], 2.5), ([_run(1, "COMPLETED")], 4.0)])
    refreshers: list[threading.Thread] = []

    def wake() -> None:  # called with the view's lock held: the refresh runs once the wait releases it
        runs, seconds = next(answers)
        clock.now += seconds
        refreshers.append(threading.Thread(target=view.refresh, args=(runs, set())))
        refreshers[-1].start()

    assert _decide(view, 2, policy="backpressure", wake=wake, poll_s=30) == ("ok", 0, 6.5, False)
    for t in refreshers:
        t.join(30)


def test_a_slot_freed_by_the_visibility_timeout_alone_ends_the_wait_at_the_next_poll(monkeypatch) -> None:
    """No refresh notifies the waiter: the wait ends at `poll_s`, and the request older than the
    visibility timeout (by the module's clock) no longer holds a slot."""
    clock = _Clock()
    monkeypatch.setattr(admission_mod, "time", SimpleNamespace(monotonic=clock.monotonic))
    view = AdmissionView("exp", visible_timeout_s=5)
    view.refresh([], set())
    view.note(event_entry(_request(1), BLOCKS))  # requested at 1000: in flight until 1005

    def wake() -> None:
        clock.now += 10.0

    assert _decide(view, 2, policy="backpressure", wake=wake, poll_s=0.01) == ("ok", 0, 10.0, False)


def test_a_spooled_request_stays_in_flight_past_the_visibility_timeout() -> None:
    view = AdmissionView("exp", visible_timeout_s=0)
    view.note(event_entry(_request(5), BLOCKS))
    assert view.refresh([], {5}) == ({5}, [])
    assert _decide(view, 6, spooled={5}) == ("busy", 1, 0.0, False)
    assert _decide(view, 6, spooled=set()) == ("ok", 0, 0.0, False)


def test_a_sent_request_whose_run_never_appears_is_handed_back_once(caplog: pytest.LogCaptureFixture) -> None:
    view = AdmissionView("exp", visible_timeout_s=0)
    request = _request(5)
    view.note(event_entry(request, BLOCKS))
    view.sent(request)
    with caplog.at_level(logging.WARNING, logger="trainer_integration.admission"):
        assert view.refresh([], set()) == ({5}, [request])
        assert view.refresh([], set()) == (set(), [])
        assert view.refresh([], set()) == (set(), [])
    assert [r.getMessage() for r in caplog.records] == [
        "pinned-eval: exp step 5: no flow run from its event; creating it",
        "pinned-eval: exp step 5 was sent but no flow run appeared",
    ]
    assert view.active() is True  # not seen on the server: the thread keeps polling
    view.seen({5})
    assert view.active() is False


def test_an_unsent_request_past_the_timeout_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    view = AdmissionView("exp", visible_timeout_s=0)
    view.note(run_request_entry(_request(3), BLOCKS))
    with caplog.at_level(logging.WARNING, logger="trainer_integration.admission"):
        assert view.refresh([], set()) == (set(), [])
        assert view.refresh([], set()) == (set(), [])
    assert [r.getMessage() for r in caplog.records] == ["pinned-eval: exp step 3 was sent but no flow run appeared"]
    assert _decide(view, 4) == ("ok", 0, 0.0, False)


def test_offline_admission_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    view = AdmissionView("exp", visible_timeout_s=60)
    with caplog.at_level(logging.INFO, logger="trainer_integration.admission"):
        assert _decide(view, 8) == ("ok", 0, 0.0, True)
    assert [r.getMessage() for r in caplog.records] == [
        "pinned-eval: exp step 8 admitted without a fresh view of the API"
    ]


# ---- the admission thread (trainer_integration/admission_sync.py) against a real loopback API ----


class _FlowRunsApi:
    """`POST /flow_runs/filter` on 127.0.0.1 answering `runs`; counts the queries it answered."""

    def __init__(self, runs: list[dict]) -> None:
        self.runs = runs
        self.queries = 0
        self.answered = threading.Condition()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = json.dumps(api.runs).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                with api.answered:
                    api.queries += 1
                    api.answered.notify_all()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _FlowRunsApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/api"

    def wait_queries(self, n: int, timeout: float) -> bool:
        with self.answered:
            return self.answered.wait_for(lambda: self.queries >= n, timeout)


def _raw_run(step: int, state: str) -> dict:
    return {
        "id": f"id{step}",
        "name": f"exp-{step}",
        "parameters": {"run": "exp", "step": step},
        "state": {"type": state, "name": state.title()},
        "created": f"2026-01-01T00:00:0{step}Z",
    }


def _sync(api: _FlowRunsApi, view: AdmissionView, enqueued: list[SpoolEntry], *, idle_sync_s: float = 30):
    rest = PrefectRest(api.url, httpx.Client(timeout=5))
    return AdmissionSync(
        "exp",
        rest,
        view,
        ExportTarget(None, None),
        BLOCKS,
        spooled=set,
        enqueue=enqueued.append,
        poll_s=30,
        idle_sync_s=idle_sync_s,
    )


def test_refresh_hands_a_lost_request_back_to_the_spool_as_a_direct_run() -> None:
    view = AdmissionView("exp", visible_timeout_s=0)
    request = _request(5)
    view.note(event_entry(request, BLOCKS))
    view.sent(request)
    enqueued: list[SpoolEntry] = []
    with _FlowRunsApi([_raw_run(1, "RUNNING")]) as api:
        sync = _sync(api, view, enqueued)
        assert sync.refresh() == {1, 5}
    assert enqueued == [run_request_entry(request, BLOCKS)]
    assert view.fresh is True


def test_wait_fresh_gives_up_after_its_timeout() -> None:
    view = AdmissionView("exp", visible_timeout_s=60)
    with _FlowRunsApi([]) as api:
        sync = _sync(api, view, [])  # never started: nothing refreshes the view
        assert sync.wait_fresh(0.05) is False


def test_an_idle_thread_still_queries_every_idle_sync_interval() -> None:
    view = AdmissionView("exp", visible_timeout_s=60)
    with _FlowRunsApi([_raw_run(1, "COMPLETED")]) as api:
        sync = _sync(api, view, [], idle_sync_s=0.05)
        sync.start()
        try:
            sync.wait_first(30)
            assert view.fresh is True and view.active() is False
            assert api.wait_queries(3, 30), f"only {api.queries} queries while idle"
        finally:
            sync.stop()
            sync.join(30)
    assert view.fresh is False  # an ended thread leaves the view stale: admission admits offline


def test_wait_first_and_join_give_up_after_their_timeouts() -> None:
    view = AdmissionView("exp", visible_timeout_s=60)
    with _FlowRunsApi([]) as api:
        sync = _sync(api, view, [])
        sync.wait_first(0.05)  # never started: returns at its timeout
        sync.start()
        try:
            sync.wait_first(30)
            sync.join(0.05)  # the thread idles for 30 s: join returns at its timeout, the thread lives on
            assert sync._thread.is_alive()
        finally:
            sync.stop()
            sync.join(30)
        assert not sync._thread.is_alive()


def test_a_step_seen_once_stays_known_when_a_later_answer_omits_it() -> None:
    view = AdmissionView("exp", visible_timeout_s=60)
    view.seen({4})
    view.refresh([_run(9, "RUNNING")], set())
    assert _decide(view, 4, max_in_flight=5) == ("exists", 1, 0.0, False)


def test_every_requested_step_is_counted_whatever_comes_before_it() -> None:
    view = AdmissionView("exp", visible_timeout_s=0)
    for step in (1, 2, 3):
        view.note(event_entry(_request(step), BLOCKS))
    view.seen({1})  # known: not counted from the requests
    # step 2 is past the visibility timeout and not spooled (not in flight); step 3 is still spooled
    assert view.refresh([], {3}) == ({3}, [])
    assert _decide(view, 4, max_in_flight=1, spooled={3}) == ("busy", 1, 0.0, False)


def test_a_failing_query_marks_the_view_stale_and_logs_at_debug_within_its_first_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused API makes the view stale (admission admits offline) and is logged at debug: a
    warning is only for a query failing for over a minute (a fresh failure must not warn)."""
    caplog.set_level(logging.DEBUG, logger="trainer_integration.admission_sync")
    with socket.socket() as sock:  # a loopback port nothing listens on: every query is refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    view = AdmissionView("exp", visible_timeout_s=60)
    rest = PrefectRest(f"http://127.0.0.1:{port}/api", httpx.Client(timeout=5))
    sync = AdmissionSync(
        "exp", rest, view, ExportTarget(None, None), BLOCKS, spooled=set, enqueue=[].append, poll_s=30,
        idle_sync_s=30,
    )
    sync.start()
    try:
        sync.wait_first(30)
        assert view.fresh is False
    finally:
        sync.stop()
        sync.join(30)
    failures = [r for r in caplog.records if "admission state of exp not refreshed" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.DEBUG]
