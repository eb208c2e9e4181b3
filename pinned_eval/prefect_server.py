"""A local Prefect server process on loopback (SQLite, filesystem lease storage), started and stopped by PID.

Used by `pinned-eval server up|down`, the demo, the benchmarks and the tests. Filesystem lease
storage keeps concurrency slots correct across a server restart (the default in-memory storage
leaks them). `PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS` bounds how long
a waiting point sleeps between slot retries.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    """Start `prefect server start` in its own session; return once `/api/health` answers 200."""
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    env = server_env(home, port)
    with open(home / "server.log", "a") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = ServerProcess(proc.pid, env["PREFECT_API_URL"], home)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}; see {home / 'server.log'}")
        try:
            if httpx.get(f"{server.api_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_server(server.pid)
            raise TimeoutError(f"prefect server not healthy after {timeout_s}s; see {home / 'server.log'}")
        time.sleep(0.5)


def process_alive(pid: int) -> bool:
    """True while `pid` runs. An exited child of this process is reaped first (a zombie is not alive)."""
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        if reaped == pid:
            return False
    except ChildProcessError:
        pass  # not our child: its parent reaps it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(pid: int, *, timeout_s: float = 15.0) -> None:
    """Stop the process group led by `pid`: SIGTERM, wait for the leader, then SIGKILL what is left."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process_alive(pid):
        time.sleep(0.2)
    with suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # stragglers of the group (or a leader past its timeout)
    process_alive(pid)  # reap


def stop_server(pid: int, *, timeout_s: float = 15.0) -> None:
    """Stop the server's whole process group (SIGTERM, then SIGKILL)."""
    stop_group(pid, timeout_s=timeout_s)


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
    import prefect.context
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

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
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

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
