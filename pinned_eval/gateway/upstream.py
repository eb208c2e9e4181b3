"""`Upstream`: the point gateway's lean HTTP/1.1 client to the router — the second hop of every
model call, without httpx's request/response model, anyio or a pool manager in between.

Contract:
- `await send(method, url, body, headers)` -> `(status, body bytes)`: one request, the body's bytes
  as given (`Content-Type: application/json` when there is one), `headers` added as given; the
  reply's bytes as they came (Content-Length or chunked; a 1xx is skipped; a reply without either
  ends at the close). It fits `RouterGenerator.forward(send=...)`, which keeps its bound, retries
  and version check. The peer is the point's router (loopback or the fleet's network), so the
  parser is small and strict: a head over 64 KiB, a reply over `MAX_REPLY` bytes or anything it
  cannot read is refused, never guessed at.
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

__all__ = ["MAX_REPLY", "Upstream"]

MAX_REPLY = 256 * 1024 * 1024  # bytes of one reply body
_HEAD = 65536  # bytes of one reply head (and the stream buffer)


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reusable: bool = False

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing() or self.reader.exception() is not None)

    def close(self) -> None:
        self.writer.close()


class Upstream:
    """Keep-alive HTTP/1.1 client for the gateway's second hop (see the module docstring)."""

    def __init__(self, *, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}  # url -> origin, request head start

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        hit = self._targets.get(url)
        if hit is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"Upstream: only http:// URLs, got {url!r}")
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            if any(c in path + parts.netloc for c in " \r\n"):
                raise ValueError(f"Upstream: no spaces or line breaks in the URL, got {url!r}")
            line = f" {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode()
            hit = self._targets[url] = ((parts.hostname, parts.port or 80), line)
        return hit

    async def send(self, method: str, url: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        origin, line = self._target(url)
        head = method.encode() + line + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        conn = await self._conn(origin)
        try:
            async with asyncio.timeout(self.timeout_s):
                conn.writer.write(head + b"\r\n" + (body or b""))
                await conn.writer.drain()
                status, data = await self._reply(conn, method == "HEAD")
        except BaseException:
            conn.close()
            raise
        if conn.reusable:
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
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*origin, limit=_HEAD), self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"connect to {origin[0]}:{origin[1]} timed out") from None
        return _Conn(reader, writer)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    @staticmethod
    async def _reply(conn: _Conn, head_only: bool) -> tuple[int, bytes]:
        """Read one reply; `conn.reusable` says whether it ended cleanly with the connection kept."""
        reader = conn.reader
        conn.reusable = False
        try:
            while True:
                status, fields = _parse_head(await reader.readuntil(b"\r\n\r\n"))
                if not 100 <= status < 200:
                    break
            keep = fields.get("connection", "").lower() != "close"
            if head_only or status in (204, 304):
                data = b""
            elif "chunked" in fields.get("transfer-encoding", "").lower():
                data = await _chunked(reader)
            elif "content-length" in fields:
                length = fields["content-length"]
                if not length.isdigit() or int(length) > MAX_REPLY:
                    raise ConnectionError(f"the router's reply has a bad Content-Length: {length[:40]!r}")
                data = await reader.readexactly(int(length))
            else:  # delimited by the close
                data, keep = await _until_eof(reader), False
        except asyncio.IncompleteReadError:
            raise ConnectionError("the router closed the connection before its reply ended") from None
        except asyncio.LimitOverrunError:
            raise ConnectionError("malformed HTTP from the router (a head or chunk line over 64 KiB)") from None
        conn.reusable = keep
        return status, data


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    """(status, headers by lower-case name) of one reply head, or `ConnectionError`."""
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise ConnectionError(f"malformed HTTP from the router: status line {lines[0][:80]!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise ConnectionError(f"malformed HTTP from the router: header line {line[:80]!r}")
            fields[name.strip().lower()] = value.strip()
    return int(code), fields


async def _until_eof(reader: asyncio.StreamReader) -> bytes:
    data = bytearray()
    while chunk := await reader.read(_HEAD):
        data += chunk
        if len(data) > MAX_REPLY:
            raise ConnectionError(f"the router's reply is over {MAX_REPLY} bytes")
    return bytes(data)


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    data = bytearray()
    while True:
        size_line = (await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise ConnectionError(f"malformed HTTP from the router: chunk size {size_line[:40]!r}") from None
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any
                pass
            return bytes(data)
        if len(data) + size > MAX_REPLY:
            raise ConnectionError(f"the router's reply is over {MAX_REPLY} bytes")
        data += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise ConnectionError("malformed HTTP from the router: a chunk not ended by CRLF")
