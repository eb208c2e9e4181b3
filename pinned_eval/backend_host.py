"""The backend host: one long-lived process beside the worker that keeps external backends warm.

Under the process worker every flow run is its own process, so a backend cached per process
(`tasks.external.BACKENDS`) would be built, and its server launched, once per point. The host
holds one `BackendCache` for every flow run of its worker:

- `python -m pinned_eval.backend_host --socket PATH` serves HTTP on a Unix socket that only the
  worker's uid can use (`pinned_eval.local_socket`: a 0700 directory of its own, a 0600 socket,
  and every connection's peer uid checked with SO_PEERCRED, another uid's closed and logged; a
  stale socket is replaced, a live one refused). `app.stack.LocalStack.worker_up` /
  `pinned-eval worker` start it beside the worker and name it to flow runs in `HOST_ENV`;
  the stack stops it by PID (SIGTERM) with the worker.
- `POST /evaluate` (`EvaluateRequest`) measures one checkpoint with the configuration's cached
  instance and answers NDJSON lines: `{"event": "heartbeat"}` every `HEARTBEAT_S` while it runs,
  then one of `{"event": "result", "results": EvalResults}`, `{"event": "skip", "reason",
  "message"}` (the backend's `EvalSkip`) or `{"event": "error", "type", "message"}`.
- Points of one configuration are measured one at a time (a lock per configuration, beside the
  flow's `backend-<class>-<digest>` concurrency limit); constructors and `dispose()` run in worker
  threads, so the host keeps answering while a backend launches its server.
- A client that goes away mid-evaluation (its point's deadline, a killed flow run) cancels the
  evaluation; the instance's state is then unknown, so it is disposed and dropped
  (`BackendCache.evaluate`). A synchronous `evaluate_checkpoint` cannot be interrupted: the
  configuration's lock stays held until the call really returns, then the instance is dropped,
  so the next point never runs beside it (one version per backend).
- Processes a backend starts through `pinned_eval.processes.start_process` get a parent-death
  signal (`children_die_with_me`): a SIGKILLed host orphans no engine.
- `GET /health` reports the host's PID, the points waiting for a configuration's lock, and each
  cached configuration by class path and `backend_lock_name` (a digest), with its evaluation
  count; never its options (they may hold keys).
- At shutdown (SIGTERM/SIGINT) running evaluations are cancelled and every cached instance is
  disposed exactly once, then the socket is removed.

`evaluate_hosted` is the flow run's side: it streams the answer and turns it back into
`EvalResults`, `EvalSkipped` or `BackendError`; an unreachable host is `BackendHostUnavailable`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.backends import BackendCache, backend_key, backend_lock_name
from pinned_eval.external import EvalInput, EvalResults
from pinned_eval.local_socket import (
    SocketInUse,
    UnsafeSocketDir,
    check_server_socket,
    foreign_peer,
    listen_private,
)
from pinned_eval.polling import poll_until
from pinned_eval.processes import children_die_with_me
from pinned_eval.skips import EvalSkipped

log = logging.getLogger(__name__)

HOST_ENV = "PINNED_EVAL_BACKEND_HOST"
HEARTBEAT_S = 1.0
_BASE_URL = "http://backend-host"  # the host part is ignored over a Unix socket


class BackendError(RuntimeError):
    """The backend raised (construction or evaluation) in the host; `type` is its exception class."""

    def __init__(self, type_name: str, message: str) -> None:
        self.type_name = type_name
        super().__init__(f"{type_name}: {message}")


class BackendHostUnavailable(RuntimeError):
    """No backend host answers on the socket (not started, or gone)."""


class EvaluateRequest(BaseModel):
    """One external point's measurement, as the flow run sends it to the host."""

    model_config = ConfigDict(extra="forbid")

    backend: str = Field(min_length=1, description="`module:Class` of the CheckpointEvalFn.")
    options: dict[str, Any] = Field(default_factory=dict, description="Constructor keywords.")
    checkpoint_dir: str = Field(min_length=1)
    input: EvalInput


# ---------------------------------------------------------------------------- server


class BackendHost:
    """The host's state: the cache, one lock per configuration, the evaluations running."""

    def __init__(self) -> None:
        self.cache = BackendCache()
        self._locks: dict[str, asyncio.Lock] = {}
        self._running: set[asyncio.Task[EvalResults]] = set()
        self.waiting = 0  # points waiting for their configuration's lock

    async def evaluate(self, req: EvaluateRequest) -> EvalResults:
        """Measure one point with the configuration's instance, one point per configuration at a time."""
        lock = self._locks.setdefault(backend_key(req.backend, req.options), asyncio.Lock())
        self.waiting += 1
        try:
            await lock.acquire()
        finally:
            self.waiting -= 1
        try:
            fn = await asyncio.to_thread(self.cache.get, req.backend, req.options)
            if inspect.iscoroutinefunction(fn.evaluate_checkpoint):
                return await self.cache.evaluate(req.backend, req.options, req.checkpoint_dir, req.input)
            return await self._evaluate_sync(req)
        finally:
            lock.release()

    async def _evaluate_sync(self, req: EvaluateRequest) -> EvalResults:
        """A synchronous backend blocks: run it in a thread with its own loop. That call cannot be
        interrupted, so when the client leaves the caller's lock stays held until it returns; then
        the instance is dropped (as a cancelled async one) and the cancellation goes on."""
        call = self.cache.evaluate(req.backend, req.options, req.checkpoint_dir, req.input)
        thread = asyncio.ensure_future(asyncio.to_thread(asyncio.run, call))
        try:
            return await asyncio.shield(thread)
        except asyncio.CancelledError:
            log.warning("%s: the client left during a synchronous evaluation (step %d); holding the "
                        "configuration until it returns", req.backend, req.input.step)
            while not thread.done():
                with contextlib.suppress(asyncio.CancelledError):  # a second cancel (shutdown) waits too
                    await asyncio.wait([thread])
            if not thread.cancelled():
                thread.exception()  # retrieved: the outcome is moot, its client is gone
            await asyncio.to_thread(self.cache.drop, req.backend, req.options)
            raise

    async def stream(self, req: EvaluateRequest) -> AsyncIterator[bytes]:
        """NDJSON: heartbeats while the evaluation runs, then its outcome; cancels it if the client leaves."""
        task = asyncio.create_task(self.evaluate(req))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        try:
            while not (await asyncio.wait([task], timeout=HEARTBEAT_S))[0]:
                yield b'{"event": "heartbeat"}\n'
            if (exc := task.exception()) is not None and not isinstance(exc, EvalSkipped):
                log.error("%s failed on %s (step %d)", req.backend, req.checkpoint_dir, req.input.step, exc_info=exc)
            yield _outcome_line(task)
        finally:
            task.cancel()  # no-op once done; else the client went away mid-evaluation

    def health(self) -> dict[str, Any]:
        """PID, waiting points and cached configurations by class path and digest: no options (keys)."""
        return {
            "pid": os.getpid(),
            "waiting": self.waiting,
            "backends": [
                {"backend": e.backend, "config": backend_lock_name(e.backend, e.options), "evaluations": e.evaluations}
                for e in self.cache.entries()
            ],
        }

    async def shutdown(self) -> None:
        """Cancel running evaluations (their instances are dropped), then dispose the rest."""
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        await asyncio.to_thread(self.cache.dispose_all)


def _outcome_line(task: asyncio.Task[EvalResults]) -> bytes:
    exc = task.exception()
    if exc is None:
        out: dict[str, Any] = {"event": "result", "results": task.result().model_dump(mode="json")}
    elif isinstance(exc, EvalSkipped):
        out = {"event": "skip", "reason": exc.reason, "message": exc.message}
    else:
        out = {"event": "error", "type": type(exc).__name__, "message": str(exc)}
    return (json.dumps(out) + "\n").encode()


def create_app(host: BackendHost, socket_path: Path | None = None) -> Any:
    """The host's FastAPI app (imported here: only the host process serves HTTP). At shutdown it
    disposes the backends, then removes `socket_path` (uvicorn then re-raises the stopping signal,
    so nothing after `serve` runs)."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        try:
            await host.shutdown()
        finally:
            if socket_path is not None:
                socket_path.unlink(missing_ok=True)

    app = FastAPI(title="pinned-eval backend host", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return host.health()

    @app.post("/evaluate")
    async def evaluate(req: EvaluateRequest) -> StreamingResponse:
        return StreamingResponse(host.stream(req), media_type="application/x-ndjson")

    return app


def _owner_only_http(socket_path: Path) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol that closes, at accept, every connection of another uid (SO_PEERCRED)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class OwnerOnlyH11(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if (refusal := foreign_peer(transport.get_extra_info("socket"), f"backend host {socket_path}")) is not None:
                log.warning(refusal)
                transport.close()

    return OwnerOnlyH11


def serve(socket_path: Path) -> None:
    """Serve until SIGTERM/SIGINT, then dispose every backend and remove the socket (the process
    then ends by that signal, as uvicorn re-raises it). `UnsafeSocketDir` / `SocketInUse` before
    serving (see `pinned_eval.local_socket`)."""
    import uvicorn

    listener = listen_private(socket_path)
    children_die_with_me()
    app = create_app(BackendHost(), socket_path)
    config = uvicorn.Config(app, http=_owner_only_http(socket_path), ws="none", log_level="warning",
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[listener])


# ---------------------------------------------------------------------------- client


def _client(socket_path: str | Path, read_timeout_s: float) -> httpx.Client:
    """A client of the host on `socket_path`; `UnsafeSocketDir` if that is not this uid's private socket
    (a squatter would receive the request, backend options included)."""
    check_server_socket(Path(socket_path))
    transport = httpx.HTTPTransport(uds=str(socket_path))
    return httpx.Client(transport=transport, base_url=_BASE_URL, timeout=httpx.Timeout(10.0, read=read_timeout_s))


def host_health(socket_path: str | Path) -> dict[str, Any]:
    """The host's `/health`; `BackendHostUnavailable` if nothing answers on the socket."""
    try:
        with _client(socket_path, 10.0) as c:
            r = c.get("/health")
            r.raise_for_status()
            return dict(r.json())
    except httpx.TransportError as exc:
        raise BackendHostUnavailable(f"no backend host answers on {socket_path}: {exc!r}") from exc


def wait_host_ready(socket_path: Path, timeout_s: float = 60.0) -> dict[str, Any]:
    """Block until the host answers `/health` (`PollTimeout` otherwise)."""
    return poll_until(
        lambda: _try_health(socket_path), timeout_s=timeout_s, interval_s=0.1, what=f"backend host on {socket_path}"
    )


def _try_health(socket_path: Path) -> dict[str, Any] | None:
    try:
        return host_health(socket_path)
    except BackendHostUnavailable:
        return None


def evaluate_hosted(
    socket_path: str | Path,
    backend: str,
    options: dict[str, Any] | None,
    checkpoint_dir: str,
    eval_input: EvalInput,
    *,
    silence_timeout_s: float = 30 * HEARTBEAT_S,
) -> EvalResults:
    """Measure one point on the host. Returns at each heartbeat to Python, so an exception injected
    into this thread (the point's deadline) lands within `HEARTBEAT_S`; a host silent for
    `silence_timeout_s` is `BackendHostUnavailable`."""
    req = EvaluateRequest(backend=backend, options=options or {}, checkpoint_dir=checkpoint_dir, input=eval_input)
    try:
        # the socket is this uid's (checked by `_client`): secrets such as a remote reward's token travel
        body = req.model_dump_json(context={"include_secrets": True})
        headers = {"content-type": "application/json"}
        with (
            _client(socket_path, silence_timeout_s) as c,
            c.stream("POST", "/evaluate", content=body, headers=headers) as r,
        ):
            if r.status_code != 200:
                raise BackendError("HostRefused", f"HTTP {r.status_code}: {r.read().decode(errors='replace')}")
            for line in r.iter_lines():
                event = json.loads(line)
                if event["event"] == "result":
                    return EvalResults.model_validate(event["results"])
                if event["event"] == "skip":
                    raise EvalSkipped(event["reason"], event["message"])
                if event["event"] == "error":
                    raise BackendError(event["type"], event["message"])
    except httpx.TransportError as exc:
        raise BackendHostUnavailable(f"backend host on {socket_path}: {exc!r}") from exc
    raise BackendHostUnavailable(f"backend host on {socket_path} closed the answer without an outcome")


def host_command(socket_path: Path, python: str = sys.executable) -> list[str]:
    """Command line of the host (run it from the project directory, so backends' modules import)."""
    return [python, "-m", "pinned_eval.backend_host", "--socket", str(socket_path)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pinned_eval.backend_host", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", type=Path, required=True, help="Unix socket to serve on.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(args.socket)
    except (SocketInUse, UnsafeSocketDir) as exc:
        sys.exit(f"backend host: {exc}")


__all__ = [
    "HOST_ENV",
    "BackendError",
    "BackendHost",
    "BackendHostUnavailable",
    "EvaluateRequest",
    "evaluate_hosted",
    "host_command",
    "host_health",
    "wait_host_ready",
]

if __name__ == "__main__":
    main()
