"""The parts of the Prefect-side admission (tasks/admission.py) that need no Prefect server: which
failures count as full / transient, and the retry of a transient one (against a refused loopback
port). The limits themselves need a server and are tested end to end (tests/e2e/test_admission.py)."""

from __future__ import annotations

import functools
import logging
import re
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
from prefect.settings import PREFECT_API_URL, temporary_settings

from tasks.admission import _hold, _is_locked, _is_transient, _QuietSkipNoise


def _acquisition_error(status: int | None) -> ConcurrencySlotAcquisitionError:
    exc = ConcurrencySlotAcquisitionError("no slot")
    if status is not None:
        request = httpx.Request("POST", "http://127.0.0.1/v2/concurrency_limits/increment")
        exc.__cause__ = httpx.HTTPStatusError("x", request=request, response=httpx.Response(status, request=request))
    return exc


@pytest.mark.parametrize(("status", "locked"), [(423, True), (404, False), (None, False)])
def test_only_a_423_means_the_limit_is_full(status: int | None, locked: bool) -> None:
    assert _is_locked(_acquisition_error(status)) is locked


def test_only_the_slot_services_423_noise_is_dropped() -> None:
    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("prefect._internal.concurrency", logging.ERROR, __file__, 1, msg, None, None)

    quiet = _QuietSkipNoise()
    assert quiet.filter(record("ConcurrencySlotAcquisitionError: 423 Locked")) is False
    assert quiet.filter(record("service crashed")) is True


@pytest.mark.parametrize(
    ("status", "transient"), [(503, True), (500, True), (502, True), (499, False), (423, False), (404, False)]
)
def test_only_server_errors_are_retried(status: int, transient: bool) -> None:
    assert _is_transient(_acquisition_error(status)) is transient


def test_a_dropped_connection_is_retried_and_other_causes_are_not() -> None:
    dropped = ConcurrencySlotAcquisitionError("no slot")
    dropped.__cause__ = httpx.RemoteProtocolError("server disconnected")
    assert _is_transient(dropped) is True
    assert _is_transient(_acquisition_error(None)) is False  # no cause: a strict limit that is missing
    assert _is_transient(RuntimeError("503")) is False  # only acquisition errors


class _StaticFiles(SimpleHTTPRequestHandler):
    """A plain static file server (stdlib) over an empty directory: GET answers 404, POST 501."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class _StaticFilesWithPost(_StaticFiles):
    """The same, serving POST as GET: every endpoint answers 404."""

    do_POST = SimpleHTTPRequestHandler.do_GET


@contextmanager
def _serving(handler: type[SimpleHTTPRequestHandler], root: Path) -> Iterator[str]:
    """A real HTTP server on loopback that is not a Prefect API; yields its API URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/api"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released): every connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _hold_at(api: str, patience_s: float) -> ConcurrencySlotAcquisitionError:
    """`_hold` of a fresh limit name (a fresh slot service, bound to `api`) until it raises."""
    name = f"eval-inflight-{uuid.uuid4().hex}"
    with (
        temporary_settings({PREFECT_API_URL: api}),
        ExitStack() as stack,
        pytest.raises(ConcurrencySlotAcquisitionError) as info,
    ):
        _hold(stack, name, max_retries=0, patience_s=patience_s)
    assert str(info.value).startswith(f"Unable to acquire concurrency slots on [{name!r}]")
    return info.value


def _hold_refused(patience_s: float) -> ConcurrencySlotAcquisitionError:
    """`_hold` against a port that refuses connections (a dropped connection: transient)."""
    port = _closed_port()
    exc = _hold_at(f"http://127.0.0.1:{port}/api", patience_s)
    cause = exc.__cause__
    assert isinstance(cause, httpx.ConnectError)
    assert cause.request.url.port == port  # the refusal came from our port, nowhere else
    return exc


def _retries(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "tasks.admission" and r.getMessage().startswith("Retrying")]


def test_a_refused_connection_is_retried_then_the_acquisition_error_is_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tasks.admission")
    _hold_refused(patience_s=8.0)  # the first retry waits 1-2 s: at least one fits in 8 s, under load too
    retries = _retries(caplog)
    assert retries, "a transient failure was not retried"
    assert {r.levelno for r in retries} == {logging.WARNING}
    assert all("ConcurrencySlotAcquisitionError" in r.getMessage() for r in retries)
    # the backoff starts at 1 s plus up to 1 s of jitter (the planned wait, as logged; not a timing)
    first_wait = float(re.search(r" in ([0-9.]+) seconds", retries[0].getMessage()).group(1))  # type: ignore[union-attr]
    assert 1.0 <= first_wait <= 2.0, retries[0].getMessage()


def test_a_server_error_is_retried(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tasks.admission")
    with _serving(_StaticFiles, tmp_path) as api:
        exc = _hold_at(api, patience_s=8.0)
    assert isinstance(exc.__cause__, httpx.HTTPStatusError)
    assert exc.__cause__.response.status_code == 501
    assert _retries(caplog), "a 5xx was not retried"


def test_a_client_error_is_raised_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tasks.admission")
    with _serving(_StaticFilesWithPost, tmp_path) as api:
        exc = _hold_at(api, patience_s=8.0)  # 8 s of patience, and not one retry
    assert isinstance(exc.__cause__, httpx.HTTPStatusError)
    assert exc.__cause__.response.status_code == 404
    assert _retries(caplog) == []


def test_no_retry_once_the_patience_is_spent(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tasks.admission")
    _hold_refused(patience_s=0.0)
    assert _retries(caplog) == []
