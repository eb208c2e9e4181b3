"""The point gateway's bare ASGI plumbing: the few pieces of Starlette it used (`Route`, `Request`,
`JSONResponse`), without Starlette's middleware stack, per-request scope copies and regex routing.

Contract:
- `App(routes)` is an ASGI HTTP app (other scope types are refused). A route's path is literal
  segments and `{name}` segments (one non-empty segment, given as `request.path_params[name]`);
  a path no route matches is 404, a route's path with another method 405 (plain text, as
  Starlette answers them).
- `Request`: `method`, `path`, `headers` (names lower-case; a repeated header's first value),
  `path_params`, `stream()` (the body's chunks as they arrive).
- `JSONResponse(content, status_code=200)`: the body is `content` as compact UTF-8 JSON (no NaN),
  `Content-Type: application/json`, as Starlette's.
This module imports no Prefect.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["ASGIApp", "App", "JSONResponse", "Receive", "Request", "Response", "Route", "Scope", "Send"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Request:
    """One HTTP request as the gateway's endpoints read it."""

    def __init__(self, scope: Scope, receive: Receive, path_params: dict[str, str]) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            self.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        self.path_params = path_params
        self._receive = receive

    async def stream(self) -> AsyncIterator[bytes]:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return


class Response:
    def __init__(self, body: bytes, status_code: int, media_type: str) -> None:
        self.body = body
        self.status_code = status_code
        self.media_type = media_type

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # an ASGI app, as Starlette's
        headers = [(b"content-type", self.media_type.encode()), (b"content-length", b"%d" % len(self.body))]
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


class JSONResponse(Response):
    def __init__(self, content: Any, status_code: int = 200) -> None:
        body = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        super().__init__(body, status_code, "application/json")


Endpoint = Callable[[Request], Awaitable[Response]]


class Route:
    def __init__(self, path: str, endpoint: Endpoint, *, methods: list[str]) -> None:
        self.path = path
        self.segments = path[1:].split("/")
        self.endpoint = endpoint
        self.methods = set(methods)

    def match(self, segments: list[str]) -> dict[str, str] | None:
        """The path parameters if `segments` fit this route, else None."""
        if len(segments) != len(self.segments):
            return None
        params: dict[str, str] = {}
        for want, got in zip(self.segments, segments, strict=True):
            if want.startswith("{") and want.endswith("}"):
                if not got:
                    return None
                params[want[1:-1]] = got
            elif want != got:
                return None
        return params


class App:
    """An ASGI app over `routes` (see the module docstring)."""

    def __init__(self, routes: list[Route]) -> None:
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise RuntimeError(f"the point gateway serves HTTP only, not {scope['type']!r}")
        segments = scope["path"][1:].split("/")
        allowed = False
        for route in self.routes:
            params = route.match(segments)
            if params is None:
                continue
            if scope["method"] in route.methods:
                response = await route.endpoint(Request(scope, receive, params))
                await response(scope, receive, send)
                return
            allowed = True
        response = Response(b"Method Not Allowed" if allowed else b"Not Found", 405 if allowed else 404,
                            "text/plain; charset=utf-8")
        await response(scope, receive, send)
