"""`Upstream`: the point gateway's lean HTTP/1.1 client to the router — the second hop of every
model call, without httpx's request/response model, anyio or a pool manager in between.

Contract:
- `await send(method, url, body, headers)` -> `(status, body bytes)`: one request, the body's bytes
  as given (`Content-Type: application/json` when there is one), `headers` added as given; the
  reply's bytes as they came (Content-Length or chunked, parsed by h11). It fits
  `RouterGenerator.forward(send=...)`, which keeps its bound, retries and version check.
- Connections are kept alive and reused, one per request in flight, per origin (`http://` only);
  an idle one the server has closed is dropped before use; a connection whose exchange did not end
  cleanly (error, timeout, cancellation, `Connection: close`) is closed, never reused.
- A transport failure (refused, reset, a malformed reply, EOF before the reply ended) is
  `ConnectionError`; a reply slower than `timeout_s` is `TimeoutError` (both `OSError`s); nothing
  is retried here.
- `aclose()` closes every idle connection; later sends open new ones.
This module imports no Prefect.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

__all__ = ["Upstream"]

_READ = 65536


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing() or self.reader.exception() is not None)

    def close(self) -> None:
        self.writer.close()


class Upstream:
    """Keep-alive HTTP/1.1 client for the gateway's second hop (see the module docstring)."""

    def __init__(self, *, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes, bytes]] = {}  # url -> origin, host, path

    def _target(self, url: str) -> tuple[tuple[str, int], bytes, bytes]:
        hit = self._targets.get(url)
        if hit is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"Upstream: only http:// URLs, got {url!r}")
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            hit = self._targets[url] = ((parts.hostname, parts.port or 80), parts.netloc.encode(), path.encode())
        return hit

    async def send(self, method: str, url: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        origin, host, path = self._target(url)
        conn = await self._conn(origin)
        try:
            async with asyncio.timeout(self.timeout_s):
                status, data = await self._exchange(conn, method.encode(), host, path, body, headers)
        except BaseException:
            conn.close()
            raise
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.close()
        return status, data

    async def _conn(self, origin: tuple[str, int]) -> _Conn:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.close()
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*origin, limit=_READ), self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"connect to {origin[0]}:{origin[1]} timed out") from None
        return _Conn(reader, writer, h11.Connection(h11.CLIENT))

    @staticmethod
    async def _exchange(
        conn: _Conn, method: bytes, host: bytes, path: bytes, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        hc = conn.h11
        fields = [(b"host", host), *((k.encode(), v.encode()) for k, v in headers.items())]
        if body is not None:
            fields += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        try:
            out = hc.send(h11.Request(method=method, target=path, headers=fields)) or b""
            if body:
                out += hc.send(h11.Data(data=body)) or b""
            out += hc.send(h11.EndOfMessage()) or b""
            conn.writer.write(out)
            await conn.writer.drain()
            status, chunks, eof = 0, [], False
            while True:
                event = hc.next_event()
                if event is h11.NEED_DATA:
                    data = await conn.reader.read(_READ)
                    eof = not data
                    hc.receive_data(data)  # b"" is EOF (which ends a reply delimited by the close)
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    chunks.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return status, b"".join(chunks)
                elif isinstance(event, h11.ConnectionClosed):
                    raise ConnectionError("the router closed the connection before its reply ended")
        except h11.ProtocolError as exc:
            if eof:
                raise ConnectionError("the router closed the connection before its reply ended") from None
            raise ConnectionError(f"malformed HTTP from the router: {exc}") from None

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
