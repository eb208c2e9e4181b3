"""`pinned_eval.gateway.asgi`, the gateway's bare ASGI plumbing, through httpx's ASGI transport:
routing (literal and `{name}` segments, 404 / 405 as Starlette answers them), the request's
headers and body, and JSON bodies byte for byte as Starlette's `JSONResponse` writes them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.responses import JSONResponse as StarletteJSON

from pinned_eval.gateway.asgi import App, JSONResponse, Request, Response, Route


async def _echo(request: Request) -> Response:
    body = b"".join([chunk async for chunk in request.stream()])
    return JSONResponse({"method": request.method, "path": request.path, "params": request.path_params,
                         "x": request.headers.get("x-key"), "body": body.decode()}, status_code=201)


APP = App([Route("/health", _echo, methods=["GET"]), Route("/sessions/{sid}/generate", _echo, methods=["POST"]),
           Route("/sessions/{sid}", _echo, methods=["DELETE"])])


@pytest.fixture
async def http() -> Any:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=APP), base_url="http://gw") as client:
        yield client


async def test_routes_params_headers_and_body(http: httpx.AsyncClient) -> None:
    r = await http.post("/sessions/abc/generate", content=b'{"a": 1}', headers=[("X-Key", "first"), ("x-key", "2")])
    assert (r.status_code, r.headers["content-type"]) == (201, "application/json")
    assert r.json() == {"method": "POST", "path": "/sessions/abc/generate", "params": {"sid": "abc"},
                        "x": "first", "body": '{"a": 1}'}
    assert (await http.delete("/sessions/xyz")).json()["params"] == {"sid": "xyz"}
    assert (await http.get("/health")).json()["params"] == {}


@pytest.mark.parametrize(("method", "path", "status", "text"), [
    ("GET", "/nope", 404, "Not Found"), ("GET", "/health/", 404, "Not Found"),
    ("DELETE", "/sessions/", 404, "Not Found"),
    ("POST", "/sessions/a/b/generate", 404, "Not Found"), ("POST", "/health", 405, "Method Not Allowed"),
    ("GET", "/sessions/a/generate", 405, "Method Not Allowed"),
])
async def test_no_route_is_404_and_another_method_405(
    http: httpx.AsyncClient, method: str, path: str, status: int, text: str
) -> None:
    r = await http.request(method, path)
    assert (r.status_code, r.text, r.headers["content-type"]) == (status, text, "text/plain; charset=utf-8")


@pytest.mark.parametrize("content", [{"é": [1, 2.5, None, True]}, "plain text", [{"a": {"b": "ü"}}]])
def test_json_bodies_are_starlettes(content: Any) -> None:
    assert JSONResponse(content).body == StarletteJSON(content).body
    with pytest.raises(ValueError, match="Out of range float"):
        JSONResponse({"x": float("nan")})
