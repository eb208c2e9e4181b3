"""A local Prefect server process on loopback (SQLite, filesystem lease storage), started and stopped by PID.

Used by `pinned-eval server up|down`, the demo, the benchmarks and the tests. Filesystem lease
storage keeps concurrency slots correct across a server restart (the default in-memory storage
leaks them). `PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS` bounds how long
a waiting point sleeps between slot retries.

Authenticated always: the server gets an API auth string (`PREFECT_SERVER_API_AUTH_STRING`,
HTTP basic `user:password`; every request but `GET /api/health` without it is a 401), the one
passed in or else the one stored in `<home>/api-auth` (generated on first use, mode 0600, in a
0700 home that also keeps the SQLite database with the block secrets from other users). Clients
send it as `PREFECT_API_AUTH_STRING` (`use_server`); it is never on a command line or in a log.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import prefect.context
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, PREFECT_HOME, temporary_settings
from prefect.utilities.asyncutils import run_coro_as_sync

from pinned_eval.processes import LaunchError, ProcessSpec, free_port, start_process, stop_groups, wait_http_ok
from pinned_eval.settings import AUTH_FILE_NAME, read_auth_file

AUTH_USER = "pinned-eval"


def private_dir(path: Path) -> Path:
    """`path` as a directory of this user's only (mode 0700; created, or tightened when it is
    ours). A symlink or another user's directory raises `PermissionError` naming it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{path}: must be a directory owned by uid {os.geteuid()}, not a symlink "
                              "or another user's")
    if st.st_mode & 0o077:
        path.chmod(0o700)
    return path


def ensure_auth_file(path: Path) -> str:
    """The API credential stored at `path`, generated first when there is none: `pinned-eval:<256
    random bits>`, written with O_EXCL at mode 0600 (a concurrent creator's file is read instead)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return read_auth_file(path).get_secret_value()
    value = f"{AUTH_USER}:{secrets.token_urlsafe(32)}"
    try:
        os.write(fd, (value + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return value


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
    auth_string: str = field(repr=False)  # what clients send as PREFECT_API_AUTH_STRING

    @property
    def ui_url(self) -> str:
        return self.api_url.removesuffix("/api")


def start_server(
    home: Path, port: int | None = None, *, auth_string: str | None = None, timeout_s: float = 120.0
) -> ServerProcess:
    """Start `prefect server start` in its own process group, its API requiring `auth_string`
    (default: `<home>/api-auth`, generated when absent); return once `/api/health` answers 200
    (`LaunchError` with the log tail, after stopping it, if it exits or times out first)."""
    private_dir(home)
    auth = auth_string if auth_string is not None else ensure_auth_file(home / AUTH_FILE_NAME)
    if not auth:
        raise ValueError("auth_string: the API credential must not be empty")
    port = port or free_port()
    spec = ProcessSpec(
        role="prefect-server",
        command=[sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=dict(server_env(home, port), PREFECT_SERVER_API_AUTH_STRING=auth, PREFECT_API_AUTH_STRING=auth),
        port=port,
        health_path="/api/health",
    )
    record, proc = start_process(spec, home / "server.log")
    try:
        wait_http_ok(record, timeout_s=timeout_s, popen=proc)
    except LaunchError:
        stop_server(record.pid)
        raise
    return ServerProcess(record.pid, f"{spec.url}/api", home, auth)


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
def use_server(api_url: str, home: Path | None = None, *, auth_string: str | None = None) -> Iterator[None]:
    """Point this process's Prefect client (all threads included), and the environment its
    children inherit, at `api_url`, sending `auth_string` when given."""

    updates: dict = {PREFECT_API_URL: api_url}
    env = {"PREFECT_API_URL": api_url}
    if home is not None:
        updates[PREFECT_HOME] = str(home)
        env["PREFECT_HOME"] = str(home)
    if auth_string is not None:
        updates[PREFECT_API_AUTH_STRING] = auth_string
        env["PREFECT_API_AUTH_STRING"] = auth_string
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
        with use_server(server.api_url, home, auth_string=server.auth_string):
            yield server
    finally:
        stop_server(server.pid)
