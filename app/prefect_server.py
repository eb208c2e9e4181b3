"""A local Prefect server process on loopback (SQLite, filesystem lease storage), started and stopped by PID.

Used by `pinned-eval server up|down`, the demo, the benchmarks and the tests. Filesystem lease
storage keeps concurrency slots correct across a server restart (the default in-memory storage
leaks them). `PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS` bounds how long
a waiting point sleeps between slot retries.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import prefect.context
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings
from prefect.utilities.asyncutils import run_coro_as_sync

from pinned_eval.processes import LaunchError, ProcessSpec, free_port, start_process, stop_groups, wait_http_ok


def server_env(home: Path, port: int, *, slot_wait_s: int = 2) -> dict[str, str]:
    """Environment of the server process (and of clients that should talk to it)."""
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE="prefect.server.concurrency.lease_storage.filesystem",
        PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS=str(slot_wait_s),
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    return env


@dataclass(frozen=True)
class ServerProcess:
    pid: int
    api_url: str
    home: Path

    @property
    def ui_url(self) -> str:
        return self.api_url.removesuffix("/api")


def start_server(home: Path, port: int | None = None, *, timeout_s: float = 120.0) -> ServerProcess:
    """Start `prefect server start` in its own process group; return once `/api/health` answers 200
    (`LaunchError` with the log tail, after stopping it, if it exits or times out first)."""
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    spec = ProcessSpec(
        role="prefect-server",
        command=[sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=server_env(home, port),
        port=port,
        health_path="/api/health",
    )
    record, proc = start_process(spec, home / "server.log")
    try:
        wait_http_ok(record, timeout_s=timeout_s, popen=proc)
    except LaunchError:
        stop_server(record.pid)
        raise
    return ServerProcess(record.pid, f"{spec.url}/api", home)


def stop_server(pid: int, *, timeout_s: float = 15.0) -> None:
    """Stop the server's whole process group (SIGTERM, then SIGKILL)."""
    stop_groups([pid], grace_s=timeout_s)


@contextmanager
def env_set(**values: str) -> Iterator[None]:
    """Set environment variables for the block (e.g. while a server process is spawned), then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def use_server(api_url: str, home: Path | None = None) -> Iterator[None]:
    """Point this process's Prefect client (all threads included) at `api_url`."""

    updates: dict = {PREFECT_API_URL: api_url}
    env = {"PREFECT_API_URL": api_url}
    if home is not None:
        updates[PREFECT_HOME] = str(home)
        env["PREFECT_HOME"] = str(home)
    with (
        env_set(**env),
        temporary_settings(updates=updates),
        prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()),
    ):
        yield
        _drain()


def _drain() -> None:
    """Flush buffered run logs and events before the server goes away."""

    async def drain() -> None:
        for result in (APILogWorker.instance().drain(), EventsWorker.drain_all()):
            if hasattr(result, "__await__"):
                await result  # type: ignore[misc]  # drain() is sync or async depending on the caller

    run_coro_as_sync(drain())


@contextmanager
def running_server(home: Path, port: int | None = None) -> Iterator[ServerProcess]:
    """A server for the duration of the block, with this process pointed at it."""
    server = start_server(home, port)
    try:
        with use_server(server.api_url, home):
            yield server
    finally:
        stop_server(server.pid)
