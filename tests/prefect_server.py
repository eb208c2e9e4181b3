"""Tests run against a real local Prefect server (see `app.prefect_server`), with API auth on, as
the product runs it: `running_prefect_server` sets `PREFECT_API_AUTH_STRING` (this process's
Prefect client and the environment of every subprocess) for its duration, and raw REST calls go
through `prefect_rest_client`, which sends it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from app.prefect_server import running_server
from pinned_eval.settings import PrefectApiSettings
from trainer_integration.rest import auth_headers

BUSY_RETRY_S = 30.0


@contextmanager
def running_prefect_server(home: Path, port: int | None = None) -> Iterator[str]:
    with running_server(home, port) as server:
        yield server.api_url


class _BusyRetryTransport(httpx.HTTPTransport):
    """Sends a request again while the server answers 503: a SQLite-backed Prefect server under
    load answers that for a locked database (Prefect's own client retries it the same way)."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        deadline = time.monotonic() + BUSY_RETRY_S
        while True:
            resp = super().handle_request(request)
            if resp.status_code != 503 or time.monotonic() > deadline:
                return resp
            resp.close()
            time.sleep(0.25)


def prefect_rest_client(base_url: str = "", **kwargs: Any) -> httpx.Client:
    """An httpx client for raw REST calls to the test Prefect server, retrying its busy 503s and
    sending the API credential of the environment (`PREFECT_API_AUTH_STRING`)."""
    defaults = {"timeout": 30, "headers": auth_headers(PrefectApiSettings())}
    return httpx.Client(base_url=base_url, transport=_BusyRetryTransport(), **{**defaults, **kwargs})
