"""`miles.utils.http_utils` as pinned-eval serves it: `post` and `init_http_client`.

Contract of `post(url, payload, max_retries=60, action="post", headers=None)` (miles' signature):
- sends JSON (`action` "post"; "get"/"delete" send no body) and returns the reply's JSON, or its
  text when it is not JSON;
- the point gateway's bearer token (set by the runner, `set_gateway_auth`) is added to every
  request to the gateway, so user code never handles it; no other header is added;
- retries are bounded: a connection error, a 429 or a 5xx is retried at most
  `min(max_retries, RETRY_CAP) - 1` times (miles retries anything 60 times at 1 s: a refused
  request would cost a minute); any other 4xx raises `httpx.HTTPStatusError` at once.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

__all__ = ["RETRY_CAP", "get", "init_http_client", "post", "set_gateway_auth"]

RETRY_CAP = 3
_RETRY_SLEEP_S = 0.2
_client: httpx.AsyncClient | None = None
_gateway: tuple[str, str] | None = None  # (base URL, token)


def set_gateway_auth(base_url: str, token: str) -> None:
    """Requests to `base_url` (the point gateway) carry `Authorization: Bearer <token>`."""
    global _gateway
    _gateway = (base_url.rstrip("/"), token)


def init_http_client(args: Any = None) -> httpx.AsyncClient:
    """The module's client (created once; miles requires this call, here it is optional)."""
    global _client
    if _client is None:
        _client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), trust_env=False)
    return _client


def _headers(url: str, headers: dict[str, str] | None) -> dict[str, str]:
    out = dict(headers or {})
    if _gateway is not None and (url == _gateway[0] or url.startswith(_gateway[0] + "/")):
        out["Authorization"] = f"Bearer {_gateway[1]}"
    return out


async def post(
    url: str, payload: Any, max_retries: int = 60, action: str = "post", headers: dict[str, str] | None = None
) -> Any:
    """One request with bounded retries (see the module docstring)."""
    client = init_http_client()
    attempts = max(1, min(max_retries, RETRY_CAP))
    for attempt in range(1, attempts + 1):
        try:
            if action in ("get", "delete"):
                response = await client.request(action.upper(), url, headers=_headers(url, headers))
            else:
                response = await client.post(url, json=payload or {}, headers=_headers(url, headers))
            response.raise_for_status()
        except httpx.HTTPStatusError as exc:
            code = exc.response.status_code
            if (code == 429 or code >= 500) and attempt < attempts:
                await asyncio.sleep(_RETRY_SLEEP_S)
                continue
            raise
        except httpx.TransportError:
            if attempt < attempts:
                await asyncio.sleep(_RETRY_SLEEP_S)
                continue
            raise
        try:
            return response.json()
        except json.JSONDecodeError:
            return response.text
    raise AssertionError("unreachable")


async def get(url: str) -> Any:
    """GET `url` (JSON reply)."""
    return await post(url, None, action="get")
