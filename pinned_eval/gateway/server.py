"""`PointGateway`: the only model address user code of one point sees — an HTTP face on its
`PointSession`, and nothing else.

Contract:
- `async with PointGateway(session, limits)` serves on 127.0.0.1, an ephemeral port (`base_url`),
  until the context exits; then nothing is left listening. Every route but `GET /health` needs
  `Authorization: Bearer <token>` (`token`, per gateway; a missing or wrong one is 401), so a
  neighbour on the node can connect but gets nothing. User code gets `token`, never the fleet's key.
- Routes: `POST /generate`, `/v1/completions`, `/v1/chat/completions`; `GET /v1/models`, `/health`;
  per sample `POST /sessions/{id}/generate`, `/sessions/{id}/v1/chat/completions`,
  `/sessions/{id}/v1/completions` (`open_sample(key)` gives `<base_url>/sessions/<id>`, an OpenAI
  base URL; an unknown id is 404). On top-level routes the header `X-SMG-Routing-Key` names the
  sample instead. Only the JSON body goes on (no header of the caller): the session adds the fleet's
  key, bounds concurrency, retries aborts and checks the weight version of every reply. The second
  hop goes over the gateway's own keep-alive client (`Upstream`, `send=`), not the point's httpx
  client; requests are parsed by uvicorn's httptools protocol (llhttp), not h11, and routed by a
  bare ASGI app (`pinned_eval.gateway.asgi`), not Starlette.
- `DELETE /sessions/{id}` closes that sample's session early (200 `{id, closed: true, calls}`):
  every later call of the sample (its session routes, or the header naming it) is 404 "session
  closed", and so is a second DELETE; calls admitted before the close finish and are recorded, so
  its `transcript(key)` is final once they are answered; `closed(key)` says so.
- Adapter mode (`session.lora`, the pinned adapter's name): every forwarded body, `/v1` routes
  included, names it as `lora_path` (SGLang's field; on `/v1` it wins over a `model` of the form
  `base:adapter`, and the router passes it on), so no call runs on the base weights under the
  adapter's version label. A body whose `lora_path` names another adapter, or any adapter on a
  full-weights point, is 400 before anything is forwarded.
- A reply of another weight version: `violation` = the `WeightVersionMismatch` (the point's skip
  `pin_violation`), the call and every later one are answered 409 naming both versions.
- Per-point budget breach (`GatewayLimits`): `violation` = `AgentBudgetExceeded` (skip
  `agent_budget`), the call and every later one are answered 429 naming the limit. A per-sample limit
  breach answers that sample's calls 429 naming the limit (`sample_breaches`); the point goes on.
- A malformed request (not a JSON object, over `MAX_BODY` bytes, `stream: true`, no `text` /
  `input_ids` / `prompt` / `messages`) is answered 4xx before anything is forwarded; an upstream 4xx
  comes back as it came; an unreachable or failing fleet is 502.
- Every call is recorded (`calls`, one `CallRecord` each, refused ones included); a sample's calls
  with their request and reply are its `transcript(key)`.
This module imports no Prefect.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from pinned_eval.fleet.errors import FleetError, GenerateRejected, WeightVersionMismatch
from pinned_eval.fleet.generate import Sender
from pinned_eval.gateway.asgi import App, ASGIApp, JSONResponse, Request, Response, Route
from pinned_eval.gateway.limits import AgentBudgetExceeded, GatewayLimits, SampleLimitExceeded
from pinned_eval.gateway.records import CallRecord, SampleState, transcript_entry
from pinned_eval.gateway.upstream import Upstream
from pinned_eval.rollout.session import PointSession

__all__ = ["MAX_BODY", "PointGateway"]

MAX_BODY = 8 * 1024 * 1024  # bytes of one request body
ROUTING_KEY = "x-smg-routing-key"
_NEEDS = {"/generate": ("text", "input_ids"), "/v1/completions": ("prompt",), "/v1/chat/completions": ("messages",)}


class _Server(uvicorn.Server):
    """uvicorn in the caller's event loop: no signal handlers of its own (the worker owns signals),
    and `ready` set once it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(message)


def _closed(key: str) -> _Refused:
    return _Refused(404, f"session closed: DELETE /sessions/{{id}} ended sample {key!r}; its transcript is final")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "code": status}, status_code=status)


class PointGateway:
    """One point's model gateway (see the module docstring)."""

    _http = "httptools"  # uvicorn's HTTP protocol (the parser of user code's requests)

    def __init__(self, session: PointSession, limits: GatewayLimits) -> None:
        self.session = session
        self.limits = limits
        self.token = secrets.token_urlsafe(32)
        self.base_url = ""
        self.calls: list[CallRecord] = []
        self.violation: BaseException | None = None
        self.sample_breaches: dict[str, str] = {}
        self._samples: dict[str, SampleState] = {}  # by sample key
        self._session_ids: dict[str, str] = {}  # session id -> sample key
        self._seq = 0
        self._tokens = 0
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        self._upstream = Upstream(timeout_s=session.request_timeout_s)
        self._send: Sender | None = self._upstream.send  # None: the point's httpx client carries it
        self._app: ASGIApp = App(self._routes())  # a subclass may wrap it (pinned_eval.delegate.gateway)

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> PointGateway:
        sock = self._listener()
        port = sock.getsockname()[1]
        config = uvicorn.Config(self._app, http=self._http, lifespan="off", log_level="warning",
                                access_log=False, proxy_headers=False, server_header=False, date_header=False,
                                timeout_graceful_shutdown=1)
        self._server = server = _Server(config)
        self._task = asyncio.create_task(server.serve(sockets=[sock]))
        ready = asyncio.create_task(server.ready.wait())
        await asyncio.wait({self._task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if not server.ready.is_set():
            ready.cancel()
            sock.close()
            self._task.result()
            raise RuntimeError("the point gateway stopped while starting")
        self._sock = sock
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    @staticmethod
    def _listener() -> socket.socket:
        """The bound socket (127.0.0.1, ephemeral port). `IPPROTO_TCP` named explicitly: asyncio turns
        Nagle off (TCP_NODELAY) only on sockets whose `proto` says TCP, and with Nagle on every reply
        (headers, then body: two writes) waited for the client's delayed ACK, ~40 ms per call."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        return sock

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        if self._sock is not None:
            self._sock.close()
        await self._upstream.aclose()
        self._server, self._task, self._sock = None, None, None

    # -- samples ---------------------------------------------------------------------------
    def open_sample(self, sample_key: str) -> str:
        """The session base URL of `sample_key` (its `/v1/chat/completions` is an OpenAI base URL)."""
        if not self.base_url:
            raise RuntimeError("open_sample: the gateway is not serving (use `async with`)")
        state = self._sample(sample_key)
        if state.session_id is None:
            state.session_id = secrets.token_urlsafe(12)
            self._session_ids[state.session_id] = sample_key
        return f"{self.base_url}/sessions/{state.session_id}"

    def closed(self, sample_key: str) -> bool:
        """Whether `sample_key`'s session was closed (`DELETE /sessions/{id}`): its transcript is final."""
        state = self._samples.get(sample_key)
        return state is not None and state.closed

    def transcript(self, sample_key: str) -> list[dict[str, Any]]:
        """The recorded calls of `sample_key`, in order (empty for a sample that made none)."""
        state = self._samples.get(sample_key)
        return [dict(e) for e in state.transcript] if state else []

    def _sample(self, key: str) -> SampleState:
        state = self._samples.get(key)
        if state is None:
            state = self._samples[key] = SampleState(key=key, opened=time.monotonic())
        return state

    # -- HTTP ------------------------------------------------------------------------------
    def _routes(self) -> list[Route]:
        post = ["POST"]
        return [
            Route("/health", self._health, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
            *(Route(p, self._handler(p, sessioned=False), methods=post) for p in _NEEDS),
            *(Route("/sessions/{sid}" + p, self._handler(p, sessioned=True), methods=post) for p in _NEEDS),
            Route("/sessions/{sid}", self._close, methods=["DELETE"]),
        ]

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def _authorized(self, request: Request) -> bool:
        given = request.headers.get("authorization", "")
        return secrets.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    async def _models(self, request: Request) -> Response:
        started = time.perf_counter()
        record = CallRecord(route="/v1/models", sample_key=None, status=401)
        try:
            if not self._authorized(request):
                record.error = "missing or wrong bearer token for this point's gateway"
                return _error(401, record.error)
            try:
                record.status, payload = await self.session.forward("GET", "/v1/models", None, rid="models",
                                                                    send=self._send)
            except (FleetError, OSError) as exc:
                record.status, record.error = 502, f"the fleet did not answer /v1/models: {exc}"
                return _error(502, record.error)
            return JSONResponse(payload, status_code=record.status)
        finally:
            record.latency_s = time.perf_counter() - started
            self.calls.append(record)

    async def _close(self, request: Request) -> Response:
        """`DELETE /sessions/{id}`: the sample's session ends; no call of it is admitted afterwards."""
        started = time.perf_counter()
        record = CallRecord(route="/sessions/{id}", sample_key=None, status=200)
        try:
            if not self._authorized(request):
                raise _Refused(401, "missing or wrong bearer token for this point's gateway")
            state = self._session_state(request.path_params["sid"])
            record.sample_key = state.key
            state.closed = True
            return JSONResponse({"id": request.path_params["sid"], "closed": True, "calls": len(state.transcript)})
        except _Refused as exc:
            record.status, record.error = exc.status, exc.message
            return _error(exc.status, exc.message)
        finally:
            record.latency_s = time.perf_counter() - started
            self.calls.append(record)

    def _handler(self, path: str, *, sessioned: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await self._call(request, path, sessioned)

        return endpoint

    async def _call(self, request: Request, path: str, sessioned: bool) -> Response:
        started = time.perf_counter()
        route = f"/sessions/{{id}}{path}" if sessioned else path
        key: str | None = None
        record = CallRecord(route=route, sample_key=None, status=0)
        try:
            if not self._authorized(request):
                raise _Refused(401, "missing or wrong bearer token for this point's gateway")
            key = self._sample_key(request, sessioned)
            record.sample_key = key
            body = self._pin_adapter(path, await self._body(request, path))
            state = self._admit(key)
            self._seq += 1
            status, payload = await self._forward(path, body, state, rid=f"gw{self._seq}")
            record.status = status
            record.fill(payload)
            self._tokens += record.prompt_tokens + record.completion_tokens
            if state is not None:
                state.tokens += record.prompt_tokens + record.completion_tokens
                state.transcript.append(transcript_entry(route, body, status, payload, record))
            return JSONResponse(payload, status_code=status)
        except _Refused as exc:
            record.status, record.error = exc.status, exc.message
            return _error(exc.status, exc.message)
        except Exception as exc:  # a gateway bug: one line to the caller, the record keeps it
            record.status, record.error = 500, f"point gateway error: {type(exc).__name__}: {exc}"
            return _error(500, record.error)
        finally:
            record.latency_s = time.perf_counter() - started
            self.calls.append(record)

    async def _forward(
        self, path: str, body: dict[str, Any], state: SampleState | None, *, rid: str
    ) -> tuple[int, Any]:
        left = self._wall_left(state)
        try:
            async with asyncio.timeout(left):
                return await self.session.forward("POST", path, body, rid=rid, send=self._send)
        except TimeoutError:
            assert state is not None
            raise self._sample_breach(state, "sample_wall_s", self.limits.sample_wall_s or 0) from None
        except WeightVersionMismatch as exc:
            if self.violation is None:
                self.violation = exc
            raise _Refused(409, f"pin violation, the point is skipped pin_violation: {exc}") from None
        except GenerateRejected as exc:
            raise _Refused(502, f"the fleet refused the request: {exc}") from None
        except (FleetError, OSError) as exc:
            raise _Refused(502, f"the fleet did not answer: {exc}") from None

    async def _body(self, request: Request, path: str) -> dict[str, Any]:
        length = request.headers.get("content-length")
        if length is not None and not length.isdigit():
            raise _Refused(400, "Content-Length: not a number")
        if length is not None and int(length) > MAX_BODY:
            raise _Refused(413, f"request body over {MAX_BODY} bytes")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                raise _Refused(413, f"request body over {MAX_BODY} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise _Refused(400, f"{path}: the body is not JSON") from None
        if not isinstance(body, dict):
            raise _Refused(400, f"{path}: the body must be one JSON object")
        if body.get("stream"):
            raise _Refused(400, f"{path}: stream: true is not supported (every reply's weight version is checked)")
        if not any(body.get(k) is not None for k in _NEEDS[path]):
            raise _Refused(400, f"{path}: missing field {' or '.join(repr(k) for k in _NEEDS[path])}")
        return body

    def _sample_key(self, request: Request, sessioned: bool) -> str | None:
        if sessioned:
            return self._session_state(request.path_params["sid"]).key
        return request.headers.get(ROUTING_KEY) or None

    def _session_state(self, sid: str) -> SampleState:
        key = self._session_ids.get(sid)
        if key is None:
            raise _Refused(404, "unknown session: open it with the gateway's open_sample")
        state = self._samples[key]
        if state.closed:
            raise _closed(key)
        return state

    def _pin_adapter(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Name the point's adapter (adapter mode) in the body, as SGLang reads it on every route:
        `lora_path` (on `/v1` it takes precedence over a `model` of the form `base:adapter`). A body
        that names another adapter, or any adapter on a full-weights point, is refused."""
        lora, given = self.session.lora, body.get("lora_path")
        names = given if isinstance(given, list) else [given]
        if lora is None and any(n is not None for n in names):
            raise _Refused(400, f"{path}: lora_path: this point serves full weights, not an adapter (leave it out)")
        if lora is not None and any(n is not None and n != lora for n in names):
            raise _Refused(400, f"{path}: lora_path: {given!r:.80} is not this point's adapter {lora!r} (leave it out)")
        return body if lora is None else {**body, "lora_path": lora}

    def _admit(self, key: str | None) -> SampleState | None:
        """Refuse the call if the point is over (violation, budget) or its sample is; else admit it."""
        lim = self.limits
        if isinstance(self.violation, WeightVersionMismatch):
            raise _Refused(409, f"pin violation, the point is skipped pin_violation: {self.violation}")
        if isinstance(self.violation, AgentBudgetExceeded):
            raise _Refused(429, f"{self.violation.limit} reached: {self.violation.message}")
        if lim.max_requests is not None and self.session.counters.requests >= lim.max_requests:
            raise self._budget("max_requests", lim.max_requests)
        if lim.max_tokens is not None and self._tokens >= lim.max_tokens:
            raise self._budget("max_tokens", lim.max_tokens)
        if key is None:
            return None
        state = self._sample(key)
        if state.closed:
            raise _closed(key)
        if state.breach is not None:
            raise _Refused(429, f"sample {key!r}: {state.breach}")
        if lim.max_turns_per_sample is not None and state.turns >= lim.max_turns_per_sample:
            raise self._sample_breach(state, "max_turns_per_sample", lim.max_turns_per_sample)
        if lim.max_tokens_per_sample is not None and state.tokens >= lim.max_tokens_per_sample:
            raise self._sample_breach(state, "max_tokens_per_sample", lim.max_tokens_per_sample)
        if self._wall_left(state) == 0:
            raise self._sample_breach(state, "sample_wall_s", lim.sample_wall_s or 0)
        state.turns += 1  # counted when admitted: concurrent calls of one sample cannot overrun it
        return state

    def _wall_left(self, state: SampleState | None) -> float | None:
        if state is None or self.limits.sample_wall_s is None:
            return None
        return max(0.0, self.limits.sample_wall_s - (time.monotonic() - state.opened))

    def _budget(self, limit: str, value: int) -> _Refused:
        exc = AgentBudgetExceeded(limit, value)
        if self.violation is None:
            self.violation = exc
        return _Refused(429, f"{limit} reached: {exc.message}")

    def _sample_breach(self, state: SampleState, limit: str, value: float) -> _Refused:
        breach = SampleLimitExceeded(state.key, limit, value)
        state.breach = str(breach)
        self.sample_breaches.setdefault(state.key, limit)
        return _Refused(429, f"{limit} reached: {breach}")
