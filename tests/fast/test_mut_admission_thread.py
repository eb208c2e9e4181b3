"""The trainer's admission thread (trainer_integration/admission_sync.py), pass by pass.

The thread's loop runs on the test's thread against a real scripted API on 127.0.0.1 (each
`POST /flow_runs/filter` gets the next scripted answer); its `_wake` / `_stop` waits are recorded
by events that return at once, and its clock is a counter the recorder advances, so which interval
it waits, when it warns and what it reads are exact values, never durations. The tests written to
kill the mutants `make mutants` makes of the thread (docs/testing.md).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

import trainer_integration.admission_sync as sync_mod
from pinned_eval.events import BlockNames
from pinned_eval.points import PointRequest, SnapshotSource
from trainer_integration.admission import AdmissionView
from trainer_integration.admission_sync import AdmissionSync
from trainer_integration.events import event_entry, run_request_entry
from trainer_integration.export_target import ExportTarget
from trainer_integration.rest import PrefectRest
from trainer_integration.spool import SpoolEntry, SpoolWriteError

LOGGER = "trainer_integration.admission_sync"
BLOCKS = BlockNames(staging="stage-x")
GARBLED = (200, b"not json")
REFUSED = (400, b'{"detail": "bad filter"}')


def _runs(*states: tuple[int, str]) -> tuple[int, bytes]:
    return 200, json.dumps([
        {"id": f"id{s}", "name": f"exp-{s}", "parameters": {"run": "exp", "step": s},
         "state": {"type": t, "name": t.title()}, "created": f"2026-01-01T00:00:0{s}Z"}
        for s, t in states
    ]).encode()


class _ScriptedApi:
    """`POST /api/flow_runs/filter` answers the next of `answers` (the last one forever after);
    `GET` of a block document answers `block`; every request's path is recorded."""

    def __init__(self, answers: list[tuple[int, bytes]], block: tuple[int, bytes] = (404, b"{}")) -> None:
        self.answers, self.block, self.paths = list(answers), block, []  # type: ignore[var-annotated]
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                api.paths.append(("POST", self.path))
                self._answer(*(api.answers.pop(0) if len(api.answers) > 1 else api.answers[0]))

            def do_GET(self) -> None:
                api.paths.append(("GET", self.path))
                self._answer(*api.block)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/api"


@pytest.fixture
def api_factory() -> Iterator[Callable[..., _ScriptedApi]]:
    started: list[_ScriptedApi] = []

    def make(answers: list[tuple[int, bytes]], **kw: Any) -> _ScriptedApi:
        api = _ScriptedApi(answers, **kw)
        api.thread.start()
        started.append(api)
        return api

    yield make
    for api in started:
        api.server.shutdown()
        api.server.server_close()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _Recorder(threading.Event):
    """The loop's `_wake`: records (timeout, view fresh?, first answered?) per wait, returns at once,
    advances the clock by the next of `ticks`, and stops the loop after `limit` waits."""

    def __init__(self, sync: AdmissionSync, limit: int, clock: _Clock | None = None, ticks: tuple = ()) -> None:
        super().__init__()
        self.sync, self.limit, self.clock, self.ticks = sync, limit, clock, list(ticks)
        self.log: list[tuple[float | None, bool, bool]] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.log.append((timeout, self.sync.view.fresh, self.sync._first.is_set()))
        if self.clock is not None:
            self.clock.now += self.ticks.pop(0)
        if len(self.log) >= self.limit:
            self.sync._stop.set()
        return self.is_set()


def _sync(
    api: _ScriptedApi,
    view: AdmissionView | None = None,
    *,
    target: ExportTarget | None = None,
    enqueue: Callable[[SpoolEntry], None] | None = None,
    spooled: Callable[[], set[int]] = set,
) -> AdmissionSync:
    return AdmissionSync(
        "exp",
        PrefectRest(api.url, httpx.Client(timeout=10)),
        view or AdmissionView("exp", visible_timeout_s=60),
        target or ExportTarget(None, None),
        BLOCKS,
        spooled=spooled,
        enqueue=enqueue or [].append,
        poll_s=0.5,
        idle_sync_s=7.0,
    )


def _request(step: int) -> PointRequest:
    return PointRequest(run="exp", step=step, source=SnapshotSource(kind="hf", path=f"/ckpt/{step}",
                                                                      require_marker=False))


def test_the_thread_is_a_named_daemon_holding_what_it_was_given(api_factory) -> None:
    api = api_factory([_runs()])
    view = AdmissionView("exp", visible_timeout_s=60)
    sync = _sync(api, view)
    assert sync.run == "exp" and sync.view is view and sync.rest.api == api.url
    assert sync._thread.name == "pinned-eval-admission" and sync._thread.daemon is True
    assert not sync._first.is_set() and not sync._stop.is_set() and not sync._wake.is_set()


def test_wake_wait_fresh_and_stop_set_what_the_loop_waits_on(api_factory) -> None:
    sync = _sync(api_factory([_runs()]))
    sync.wake()
    assert sync._wake.is_set() and not sync._stop.is_set()
    sync._wake.clear()
    assert sync.wait_fresh(0.0) is False  # nothing refreshed the view
    assert sync._wake.is_set()
    sync._wake.clear()
    sync.stop()
    assert sync._stop.is_set() and sync._wake.is_set()


def test_it_polls_while_a_point_may_be_in_flight_or_the_query_fails_and_idles_otherwise(api_factory) -> None:
    api = api_factory([_runs((1, "RUNNING")), _runs((1, "COMPLETED")), REFUSED, GARBLED, _runs((1, "COMPLETED"))])
    sync = _sync(api)
    wake = sync._wake = _Recorder(sync, limit=5)
    sync._loop()
    assert wake.log == [(0.5, True, True), (7.0, True, True), (0.5, False, True), (0.5, False, True),
                        (7.0, True, True)]
    assert [p for p in api.paths if p[0] == "POST"] == [("POST", "/api/flow_runs/filter")] * 5
    assert sync.view.fresh is False  # an ended thread leaves the view stale: admission admits offline


def test_a_failing_query_is_a_warning_only_once_it_has_failed_for_over_a_minute(
    api_factory, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    api = api_factory([GARBLED, GARBLED, GARBLED, GARBLED, GARBLED, _runs(), GARBLED])
    clock = _Clock()
    monkeypatch.setattr(sync_mod, "time", SimpleNamespace(monotonic=clock.monotonic))
    sync = _sync(api)
    sync._wake = _Recorder(sync, limit=7, clock=clock, ticks=(30.0, 30.0, 1.0, 29.0, 30.0, 30.0, 0.0))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        sync._loop()
    message = "pinned-eval: admission state of exp not refreshed (Expecting value: line 1 column 1 (char 0))"
    # failing for 0, 30, 60 s: debug; 61, 90 s: warning; a good answer restarts the clock
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER] == [
        (logging.DEBUG, message), (logging.DEBUG, message), (logging.DEBUG, message), (logging.WARNING, message),
        (logging.WARNING, message), (logging.DEBUG, message),
    ]


def test_a_fallback_re_send_that_cannot_be_spooled_is_logged_and_the_thread_lives_on(
    api_factory, caplog: pytest.LogCaptureFixture
) -> None:
    view = AdmissionView("exp", visible_timeout_s=0)
    request = _request(5)
    view.note(event_entry(request, BLOCKS))
    view.sent(request)  # sent, and its run never appears: handed back for a direct run request

    def full_disk(entry: SpoolEntry) -> None:
        raise SpoolWriteError(28, "spool /s: run_request for step 5 not written: No space left on device")

    sync = _sync(api_factory([_runs()]), view, enqueue=full_disk)
    wake = sync._wake = _Recorder(sync, limit=2)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        sync._loop()
    assert len(wake.log) == 2 and wake.log[0][2] is True
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER] == [
        (logging.ERROR, "pinned-eval: fallback re-send for exp not spooled: "
                        "[Errno 28] spool /s: run_request for step 5 not written: No space left on device")
    ]


def test_refresh_hands_each_lost_request_back_with_the_clients_blocks(api_factory) -> None:
    view = AdmissionView("exp", visible_timeout_s=0)
    for step in (5, 6):
        view.note(event_entry(_request(step), BLOCKS))
        view.sent(_request(step))
    enqueued: list[SpoolEntry] = []
    sync = _sync(api_factory([_runs((1, "RUNNING"), (2, "COMPLETED"))]), view, enqueue=enqueued.append,
                 spooled=lambda: {6})
    assert sync.refresh() == {1, 5, 6}
    assert enqueued == [run_request_entry(_request(5), BLOCKS)]  # 6 is still in the spool: not lost


def test_each_pass_reads_the_staging_block_until_it_has_its_credentials(api_factory) -> None:
    block = {"data": {"endpoint_url": "http://127.0.0.1:1", "region_name": "us-east-1",
                      "aws_access_key_id": "AK", "aws_secret_access_key": "SK"}}
    api = api_factory([_runs()], block=(200, json.dumps(block).encode()))
    target = ExportTarget("s3://bucket/stage", None)
    sync = _sync(api, target=target)
    sync._wake = _Recorder(sync, limit=2)
    sync._loop()
    path = "/api/block_types/slug/pinned-eval-staging/block_documents/name/stage-x?include_secrets=true"
    assert [p for p in api.paths if p[0] == "GET"] == [("GET", path)]  # read once, then no more
    assert target.wants_block is False


def test_a_staging_block_not_readable_yet_is_logged_at_debug_and_read_again(
    api_factory, caplog: pytest.LogCaptureFixture
) -> None:
    api = api_factory([_runs()], block=(400, b"{}"))
    target = ExportTarget("s3://bucket/stage", None)
    sync = _sync(api, target=target)
    sync._wake = _Recorder(sync, limit=2)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        sync._loop()
    assert len([p for p in api.paths if p[0] == "GET"]) == 2 and target.wants_block is True
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert len(logged) == 2 and all(level == logging.DEBUG for level, _ in logged)
    assert all(m.startswith("pinned-eval: staging block 'stage-x' not read yet (Client error '400 Bad Request'")
               for _, m in logged)


def test_without_an_s3_target_no_block_is_read(api_factory) -> None:
    api = api_factory([_runs()])
    sync = _sync(api)
    sync._wake = _Recorder(sync, limit=2)
    sync._loop()
    assert [p for p in api.paths if p[0] == "GET"] == []


def test_an_unexpected_error_ends_the_thread_with_the_view_stale_and_first_set(api_factory) -> None:
    sync = _sync(api_factory([_runs()]), spooled=lambda: 1 / 0)  # type: ignore[return-value,arg-type]
    with pytest.raises(ZeroDivisionError):
        sync._loop()
    assert sync._first.is_set() and sync.view.fresh is False
