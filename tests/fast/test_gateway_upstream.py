"""`pinned_eval.gateway.upstream.Upstream`, the gateway's second hop, against a raw asyncio HTTP
server on loopback that records every connection and request: bytes through unchanged, keep-alive
reuse, chunked replies, connections the server closed are not reused, transport failures and
timeouts are `OSError`s, and `RouterGenerator.forward(send=...)` turns them into `FleetError`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from pinned_eval.fleet.errors import FleetError
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.gateway.upstream import Upstream

CANNED = {
    b"/continue": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"/nocontent": b"HTTP/1.1 204 No Content\r\n\r\n",
    b"/eof": b"HTTP/1.1 200 OK\r\n\r\nuntil the close",
    b"/bad": b"SMTP ready\r\n\r\n",
    b"/badlength": b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"/huge": b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 70000 + b"\r\n\r\n",
}


class RawServer:
    """HTTP/1.1 by hand: each request's head and body recorded with its connection's number; the reply
    per request path: `CANNED` as written, `/chunked` chunked, `/close` with `Connection: close`,
    `/hang` never, `/cut` the connection dropped before a reply; else Content-Length JSON echoing the body."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[tuple[int, bytes, bytes]] = []  # (connection, head, body)
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append((conn, head, body))
                path = head.split(b" ")[1]
                if path == b"/hang":
                    await asyncio.Event().wait()
                if path == b"/cut":
                    break
                if path in CANNED:
                    writer.write(CANNED[path])
                    await writer.drain()
                    if path in (b"/eof", b"/bad", b"/huge"):
                        break
                    continue
                if path == b"/chunked":
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 b"3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n")
                elif path == b"/close":
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
                                 b"Content-Length: 2\r\n\r\n{}")
                    await writer.drain()
                    break
                else:
                    reply = b'{"echo":' + (body or b"null") + b"}"
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                 + str(len(reply)).encode() + b"\r\n\r\n" + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def raw() -> AsyncIterator[tuple[RawServer, str]]:
    server = RawServer()
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    try:
        yield server, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    finally:
        srv.close()
        for w in server.writers:
            w.close()


async def test_bytes_go_through_unchanged_on_one_kept_alive_connection(raw: tuple[RawServer, str]) -> None:
    server, url = raw
    up = Upstream(timeout_s=5)
    body = '{"text":"héllo","n":1}'.encode()
    for _ in range(3):
        assert await up.send("POST", f"{url}/generate", body, {"Authorization": "Bearer k"}) == (
            200, b'{"echo":' + body + b"}")
    assert await up.send("GET", f"{url}/v1/models", None, {}) == (200, b'{"echo":null}')
    assert server.connections == 1 and [c for c, _, _ in server.requests] == [1, 1, 1, 1]
    _, head, sent = server.requests[0]
    assert sent == body
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /generate HTTP/1.1"
    assert {b"authorization: Bearer k", b"content-type: application/json",
            f"content-length: {len(body)}".encode()} <= {ln.split(b":")[0].lower() + b":" + ln.split(b":", 1)[1]
                                                         for ln in lines[1:] if b":" in ln}
    assert not any(ln.lower().startswith(b"content-length") for ln in server.requests[3][1].split(b"\r\n"))
    await up.aclose()


async def test_concurrent_calls_use_one_connection_each(raw: tuple[RawServer, str]) -> None:
    server, url = raw
    up = Upstream(timeout_s=5)
    replies = await asyncio.gather(*(up.send("POST", f"{url}/x", str(i).encode(), {}) for i in range(4)))
    assert sorted(replies) == [(200, b'{"echo":%d}' % i) for i in range(4)]
    assert server.connections == 4
    await up.send("POST", f"{url}/x", b"5", {})
    assert server.connections == 4  # an idle one was reused
    await up.aclose()


async def test_a_chunked_reply_is_joined(raw: tuple[RawServer, str]) -> None:
    _, url = raw
    up = Upstream(timeout_s=5)
    assert await up.send("GET", f"{url}/chunked", None, {}) == (200, b'{"a":1}')
    await up.aclose()


async def test_a_connection_the_server_closed_is_not_reused(raw: tuple[RawServer, str]) -> None:
    server, url = raw
    up = Upstream(timeout_s=5)
    assert await up.send("POST", f"{url}/close", b"{}", {}) == (503, b"{}")
    assert await up.send("POST", f"{url}/x", b"1", {}) == (200, b'{"echo":1}')
    assert server.connections == 2
    server.writers[-1].close()  # the server drops the idle kept-alive connection
    await asyncio.wait_for(_until(lambda: all(c.reader.at_eof() for c in up._idle[("127.0.0.1", _port(url))])), 5)
    assert await up.send("POST", f"{url}/x", b"2", {}) == (200, b'{"echo":2}')
    assert server.connections == 3
    await up.aclose()


async def test_failures_are_oserrors_and_fleet_errors_through_forward(raw: tuple[RawServer, str]) -> None:
    server, url = raw
    up = Upstream(timeout_s=0.3)
    with pytest.raises(ConnectionError, match="closed the connection before its reply ended"):
        await up.send("POST", f"{url}/cut", b"{}", {})
    assert [head.split(b" ")[1] for _, head, _ in server.requests] == [b"/cut"]  # sent once, not retried
    with pytest.raises(TimeoutError):
        await up.send("POST", f"{url}/hang", b"{}", {})
    assert up._idle == {}  # neither connection kept
    async with httpx.AsyncClient() as http:
        gen = RouterGenerator(http, url, api_key="k")
        with pytest.raises(FleetError, match=r"router http://127\.0\.0\.1:\d+ unreachable: ConnectionError"):
            await gen.forward("POST", "/cut", {"text": "x"}, "1", send=up.send)
        dead = RouterGenerator(http, "http://127.0.0.1:9")
        with pytest.raises(FleetError, match="unreachable"):
            await dead.forward("GET", "/v1/models", None, None, send=up.send)
    with pytest.raises(ValueError, match="only http:// URLs"):
        await up.send("GET", "https://127.0.0.1:1/x", None, {})
    await up.aclose()


async def test_forward_sends_the_same_bytes_either_way(raw: tuple[RawServer, str]) -> None:
    server, url = raw
    body: dict[str, Any] = {"text": "é", "sampling_params": {"max_new_tokens": 2}}
    up = Upstream(timeout_s=5)
    async with httpx.AsyncClient() as http:
        gen = RouterGenerator(http, url, api_key="k")
        via_httpx = await gen.forward("POST", "/v1/models", body, None)
        via_upstream = await gen.forward("POST", "/v1/models", body, None, send=up.send)
    assert via_httpx == via_upstream == (200, {"echo": body})
    wire = '{"text":"é","sampling_params":{"max_new_tokens":2}}'.encode()
    assert server.requests[0][2] == server.requests[1][2] == wire
    await up.aclose()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _until(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0.01)


async def test_the_gateway_keeps_one_connection_to_the_router_and_closes_it_on_exit(
    raw: tuple[RawServer, str],
) -> None:
    from pinned_eval.gateway import GatewayLimits, PointGateway
    from pinned_eval.rollout.session import PointSession

    server, url = raw
    async with httpx.AsyncClient() as http:
        session = PointSession(RouterGenerator(http, url, api_key="fleet"), expected_version="1", rid_prefix="p")
        async with PointGateway(session, GatewayLimits()) as gw:
            for _ in range(3):
                r = await http.get(f"{gw.base_url}/v1/models", headers={"Authorization": f"Bearer {gw.token}"})
                assert (r.status_code, r.json()) == (200, {"echo": None})
            idle = list(gw._upstream._idle[("127.0.0.1", _port(url))])
        assert server.connections == 1 and len(server.requests) == 3 and len(idle) == 1
        assert b"authorization: Bearer fleet" in server.requests[0][1].lower().replace(b"bearer", b"Bearer")
        assert idle[0].writer.is_closing() and gw._upstream._idle == {}


async def test_reply_framing_and_refusals(raw: tuple[RawServer, str]) -> None:
    server, url = raw
    up = Upstream(timeout_s=5)
    assert await up.send("GET", f"{url}/continue", None, {}) == (200, b"ok")  # the 1xx skipped
    assert await up.send("GET", f"{url}/nocontent", None, {}) == (204, b"")
    assert server.connections == 1  # both kept the connection
    assert await up.send("GET", f"{url}/eof", None, {}) == (200, b"until the close")
    assert up._idle[("127.0.0.1", _port(url))] == []  # a close-delimited reply ends its connection
    for path, message in [("/bad", "status line 'SMTP ready'"), ("/badlength", "bad Content-Length: '-1'"),
                          ("/huge", "a head or chunk line over 64 KiB")]:
        with pytest.raises(ConnectionError, match=message):
            await up.send("GET", f"{url}{path}", None, {})
    with pytest.raises(ValueError, match="no spaces or line breaks"):
        await up.send("GET", f"{url}/a b", None, {})
    await up.aclose()


async def test_the_gateway_parses_with_httptools() -> None:
    from pinned_eval.gateway import GatewayLimits, PointGateway
    from pinned_eval.rollout.session import PointSession

    async with httpx.AsyncClient() as http:
        session = PointSession(RouterGenerator(http, "http://127.0.0.1:9"), expected_version="1", rid_prefix="p")
        async with PointGateway(session, GatewayLimits()) as gw:
            assert gw._server is not None and gw._server.config.http_protocol_class.__name__ == "HttpToolsProtocol"
            assert (await http.get(f"{gw.base_url}/health")).json() == {"status": "ok"}


async def test_an_https_router_keeps_the_httpx_client() -> None:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url} {request.headers['authorization']} {request.content.decode()}")
        return httpx.Response(200, json={"ok": 1})

    async def never(*args: Any) -> tuple[int, bytes]:
        raise AssertionError("send= used for an https:// router")

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        gen = RouterGenerator(http, "https://router.example:8443", api_key="k")
        assert await gen.forward("POST", "/v1/models", {"a": "é"}, None, send=never) == (200, {"ok": 1})
    assert seen == ['POST https://router.example:8443/v1/models Bearer k {"a":"é"}']
