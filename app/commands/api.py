"""The Prefect API every verb talks to: `prefect_client()` finds it (the URL and credential), checks
that it answers (`check_reachable`, else `unreachable`: one line, exit 1), points this process at it
while the verb runs, and sends the events Prefect queued before the verb ends (`drain_events`).
Prefect is imported inside the functions: `pinned-eval --help` stays fast.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, NoReturn

import httpx

from app.commands._cli import fail, in_words
from pinned_eval.settings import AUTH_FILE_ENV, PrefectApiSettings, get_settings

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient


@contextlib.contextmanager
def prefect_client() -> Iterator[SyncPrefectClient]:
    """A sync client of the API, this process pointed at it while the block runs (flows run here
    too); exit 2 when none is configured, 1 when unreachable.

    The URL is `PREFECT_API_URL`, else the one `pinned-eval server up` recorded in the home; the
    credential is `PREFECT_API_AUTH_STRING` or `PINNED_EVAL_API_AUTH_FILE`, else the home's
    `api-auth`, sent only to the home's own server (never to another URL)."""
    from prefect import get_client  # prefect: slow import; `pinned-eval --help` stays fast
    from prefect.settings import get_current_settings  # prefect: slow import; `pinned-eval --help` stays fast

    from app.prefect_server import use_server  # prefect: slow import; `pinned-eval --help` stays fast
    from app.stack import LocalStack  # prefect: slow import; `pinned-eval --help` stays fast

    stack = LocalStack(get_settings().home)
    recorded = stack.state().api_url
    current = get_current_settings().api
    url = current.url or recorded
    if not url:
        fail("no Prefect API: run `pinned-eval server up`, or set PREFECT_API_URL "
             "(e.g. `export PREFECT_API_URL=http://127.0.0.1:4200/api`)", 2)
    try:
        configured = current.auth_string or PrefectApiSettings().api_auth_string
    except (OSError, ValueError) as exc:
        fail(f"{AUTH_FILE_ENV}: {exc}", 2)
    auth = configured.get_secret_value() if configured is not None else None
    if auth is None and url == recorded and stack.auth_file.exists():
        auth = stack.auth_string()
    current_auth = current.auth_string.get_secret_value() if current.auth_string is not None else None
    same = url == current.url and auth == current_auth  # nothing to change
    check_reachable(url)
    try:
        with (contextlib.nullcontext() if same else use_server(url, auth_string=auth),
              get_client(sync_client=True) as client):
            try:
                yield client
            finally:
                drain_events()
    except httpx.TransportError as exc:
        unreachable(url, exc)


def unreachable(url: str, exc: BaseException) -> NoReturn:
    """Exit 1: the API at `url` does not answer; say where the URL came from and how to start a server."""
    stack_home = get_settings().home
    from_home = os.environ.get("PREFECT_API_URL") != url
    hint = (f" (the server {stack_home} recorded: is it up? `pinned-eval server up`)" if from_home else
            " (PREFECT_API_URL): is that server up? `pinned-eval server up` starts this home's")
    fail(f"cannot reach the Prefect API at {url}{hint}: {in_words(exc)}")


def check_reachable(url: str) -> None:
    """One plain `GET /health` (no retries) before the verb: a server that is down is one line naming
    `pinned-eval server up` at once, whatever Prefect call the verb would have failed in, and after
    however many retries."""
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=10.0)
    except httpx.TransportError as exc:
        unreachable(url, exc)
    except httpx.InvalidURL as exc:
        fail(f"the Prefect API URL {url!r} is not a URL: {in_words(exc)}", 2)


EVENTS_DRAIN_S = 5.0


def drain_events() -> None:
    """Send the events Prefect's client queued (a block load emits one) while this process still
    points at the server, and stop its events thread: left to the interpreter's exit, the drain took
    seconds and raced native threads' teardown (pyarrow's), aborting `compare` (exit 134,
    "terminate called without an active exception") after it printed its answer."""
    import logging

    from prefect.events.worker import EventsWorker  # prefect: slow import; `pinned-eval --help` stays fast

    quiet = logging.getLogger(EventsWorker.__name__)  # its "Still processing items: 1 items remaining..."
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        EventsWorker.drain_all(timeout=EVENTS_DRAIN_S)
    finally:
        quiet.setLevel(level)
