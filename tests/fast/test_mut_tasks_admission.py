"""The pure parts of the Prefect-side admission (tasks/admission.py); the limits themselves need a
Prefect server and are tested end to end (tests/e2e/test_admission.py)."""

from __future__ import annotations

import logging

import httpx
import pytest
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError

from tasks.admission import _is_locked, _is_transient, _QuietSkipNoise


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
