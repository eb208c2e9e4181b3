"""`UrlTokenGateway`: a `PointGateway` whose token can also be the first path segment.

A delegate is handed one URL, miles' `router_url`, and NeMo-Skills talks to it with an OpenAI
client whose key is `EMPTY`: it cannot send the gateway's bearer token. So the token travels in
that URL: `router_url` = `<base_url>/t/<token>`, and a request to `/t/<token>/<route>` is served
as `/<route>` with `Authorization: Bearer <token>` (any `Authorization` the caller sent is
replaced). The gateway's own check then applies: a wrong token is 401, as with the header.
Everything else is `PointGateway`'s (routes, version check, budget, records).
This module imports no Prefect.
"""

from __future__ import annotations

from pinned_eval.gateway import GatewayLimits, PointGateway
from pinned_eval.gateway.asgi import ASGIApp, Receive, Scope, Send
from pinned_eval.rollout.session import PointSession

__all__ = ["PREFIX", "UrlTokenGateway"]

PREFIX = "/t/"


class _TokenInPath:
    """ASGI middleware: `/t/<token>/<rest>` -> `/<rest>` with `Authorization: Bearer <token>`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith(PREFIX):
            token, sep, rest = path[len(PREFIX):].partition("/")
            if sep:
                headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"authorization"]
                headers.append((b"authorization", b"Bearer " + token.encode("latin-1", "replace")))
                scope = {**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode(), "headers": headers}
        await self.app(scope, receive, send)


class UrlTokenGateway(PointGateway):
    """A point gateway reachable at `router_url` without a header (see the module docstring)."""

    def __init__(self, session: PointSession, limits: GatewayLimits) -> None:
        super().__init__(session, limits)
        self._app = _TokenInPath(self._app)

    async def __aenter__(self) -> UrlTokenGateway:
        await super().__aenter__()
        return self

    @property
    def router_url(self) -> str:
        """The URL a delegate gets as miles' `router_url` (it holds the token: give it to no one else)."""
        if not self.base_url:
            raise RuntimeError("router_url: the gateway is not serving (use `async with`)")
        return f"{self.base_url}{PREFIX}{self.token}"
