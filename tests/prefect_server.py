"""Tests run against a real local Prefect server (see `app.prefect_server`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app.prefect_server import running_server


@contextmanager
def running_prefect_server(home: Path, port: int | None = None) -> Iterator[str]:
    with running_server(home, port) as server:
        yield server.api_url
