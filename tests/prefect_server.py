"""Start a real Prefect server on loopback for tests, and point this process's Prefect client at it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def server_env(home: Path, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE="prefect.server.concurrency.lease_storage.filesystem",
        PREFECT_SERVER_UI_ENABLED="true",
        PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="true",
        PREFECT_LOGGING_LEVEL="WARNING",
        # a waiting acquirer retries a full limit after at most this many seconds (default 30)
        PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS="1",
    )
    return env


def _drain_prefect_workers() -> None:
    """Flush buffered run logs and events before the server goes away."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        for result in (APILogWorker.instance().drain(), EventsWorker.drain_all()):
            if hasattr(result, "__await__"):
                await result

    run_coro_as_sync(drain())


@contextmanager
def running_prefect_server(home: Path, *, timeout_s: float = 90.0) -> Iterator[str]:
    import prefect.context
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from tests.conftest import free_port

    port = free_port()
    env = server_env(home, port)
    log = open(home / "server.log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = env["PREFECT_API_URL"]
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {proc.returncode}; see {home / 'server.log'}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefect server not healthy after {timeout_s}s")
            time.sleep(0.5)
        saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME")}
        os.environ["PREFECT_API_URL"] = url
        os.environ["PREFECT_HOME"] = str(home)
        try:
            with (
                temporary_settings(updates={PREFECT_API_URL: url, PREFECT_HOME: str(home)}),
                # threads and copied contextvars must see this server too, not an ephemeral one
                prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()),
            ):
                yield url
                _drain_prefect_workers()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
