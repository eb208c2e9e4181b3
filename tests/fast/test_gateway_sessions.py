"""The point gateway's session close (`DELETE /sessions/{id}`), its adapter pinning on every route, and
its sockets (Nagle off), over real HTTP on loopback against the recording fake fleet of
tests/fast/test_gateway.py (docs/agentic.md)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest

from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.gateway import GatewayLimits, PointGateway
from pinned_eval.rollout.session import PointSession
from tests.fast.test_gateway import FLEET_KEY, FakeFleet, auth, fleet, http

__all__ = ["fleet", "http"]  # fixtures, used by name

CHAT = {"model": "m", "messages": [{"role": "user", "content": "q"}]}


def _gateway(url: str, http: httpx.AsyncClient, lora: str | None = None) -> PointGateway:
    session = PointSession(RouterGenerator(http, url, api_key=FLEET_KEY), expected_version="7", rid_prefix="pt3",
                           lora=lora)
    return PointGateway(session, GatewayLimits())


async def test_delete_closes_a_session_and_its_transcript_is_final(
    fleet: tuple[FakeFleet, str], http: httpx.AsyncClient
) -> None:
    fake, url = fleet
    async with _gateway(url, http) as gw:
        a, b = gw.open_sample("a"), gw.open_sample("b")
        assert (await http.post(f"{a}/v1/chat/completions", headers=auth(gw), json=CHAT)).status_code == 200
        assert (await http.delete(a)).status_code == 401  # the token, as on every route
        assert not gw.closed("a")
        closed = await http.delete(a, headers=auth(gw))
        assert closed.status_code == 200
        assert closed.json() == {"id": a.rsplit("/", 1)[1], "closed": True, "calls": 1}
        assert gw.closed("a") and not gw.closed("b")
        later = [
            await http.post(f"{a}/v1/chat/completions", headers=auth(gw), json=CHAT),
            await http.post(f"{a}/generate", headers=auth(gw), json={"text": "x"}),
            await http.post(f"{gw.base_url}/generate", headers=auth(gw, **{"X-SMG-Routing-Key": "a"}),
                            json={"text": "x"}),
            await http.delete(a, headers=auth(gw)),
        ]
        assert [r.status_code for r in later] == [404, 404, 404, 404]
        assert all(r.json()["message"] == "session closed: DELETE /sessions/{id} ended sample 'a'; "
                                          "its transcript is final" for r in later)
        assert len(fake.seen) == 1  # nothing of the closed sample was forwarded
        assert [(t["route"], t["status"]) for t in gw.transcript("a")] == [("/sessions/{id}/v1/chat/completions", 200)]
        assert (await http.post(f"{b}/v1/chat/completions", headers=auth(gw), json=CHAT)).status_code == 200
        assert (await http.delete(f"{gw.base_url}/sessions/nope", headers=auth(gw))).status_code == 404
        assert [(c.route, c.sample_key, c.status) for c in gw.calls] == [
            ("/sessions/{id}/v1/chat/completions", "a", 200), ("/sessions/{id}", None, 401),
            ("/sessions/{id}", "a", 200), ("/sessions/{id}/v1/chat/completions", None, 404),
            ("/sessions/{id}/generate", None, 404), ("/generate", "a", 404), ("/sessions/{id}", None, 404),
            ("/sessions/{id}/v1/chat/completions", "b", 200), ("/sessions/{id}", None, 404),
        ]
        assert gw.violation is None


async def test_a_call_in_flight_at_the_close_finishes_and_is_recorded(
    fleet: tuple[FakeFleet, str], http: httpx.AsyncClient
) -> None:
    fake, url = fleet
    async with _gateway(url, http) as gw:
        base = gw.open_sample("s")
        call = asyncio.create_task(http.post(f"{base}/generate", headers=auth(gw), json={"text": "hang"}))
        while not fake.seen:  # the call reached the fleet
            await asyncio.sleep(0.01)
        assert (await http.delete(base, headers=auth(gw))).json()["calls"] == 0
        fake.release.set()
        assert (await call).json()["text"] == "echo:hang"
        assert [t["text"] for t in gw.transcript("s")] == ["echo:hang"]
        assert (await http.post(f"{base}/generate", headers=auth(gw), json={"text": "x"})).status_code == 404


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
async def test_adapter_mode_names_the_pinned_adapter_on_every_route(
    fleet: tuple[FakeFleet, str], http: httpx.AsyncClient, route: str
) -> None:
    fake, url = fleet
    body: dict[str, Any] = {"/generate": {"text": "x"}, "/v1/completions": {"model": "m", "prompt": "x"},
                            "/v1/chat/completions": CHAT}[route]
    async with _gateway(url, http, lora="7") as gw:
        for given in ({}, {"lora_path": "7"}, {"model": "base:7"}):
            r = await http.post(f"{gw.base_url}{route}", headers=auth(gw), json={**body, **given})
            assert r.status_code == 200, r.text
        assert [b["lora_path"] for _, _, b in fake.seen] == ["7", "7", "7"]
        assert fake.seen[2][2].get("model", "base:7") == "base:7"  # `model` goes on as given
        other = await http.post(f"{gw.base_url}{route}", headers=auth(gw), json={**body, "lora_path": "6"})
        assert other.status_code == 400
        assert other.json()["message"] == f"{route}: lora_path: '6' is not this point's adapter '7' (leave it out)"
        assert len(fake.seen) == 3
    async with _gateway(url, http) as gw:  # full weights: no adapter may be named
        r = await http.post(f"{gw.base_url}{route}", headers=auth(gw), json={**body, "lora_path": "7"})
        assert r.status_code == 400
        assert r.json()["message"] == (f"{route}: lora_path: this point serves full weights, not an adapter "
                                       "(leave it out)")
        assert len(fake.seen) == 3


async def test_accepted_connections_have_nagle_off(fleet: tuple[FakeFleet, str], http: httpx.AsyncClient) -> None:
    """With Nagle on, each reply's body (a second write) waited for the client's delayed ACK."""
    _, url = fleet
    async with _gateway(url, http) as gw:
        port = int(gw.base_url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert gw._server is not None
        accepted = [c.transport.get_extra_info("socket") for c in gw._server.server_state.connections]
        assert len(accepted) == 1
        assert accepted[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        writer.close()
        await writer.wait_closed()
