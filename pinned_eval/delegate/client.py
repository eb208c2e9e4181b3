"""Posting to a delegate as miles does, treating it as a hostile neighbour; its reply as metrics.

Contract:
- `post(spec, body)`: POST `body` (`config.request_body`) to `spec.url` with `Content-Type:
  application/json` (unless the delegate's `headers` set one) and the delegate's `headers`;
  `spec.attempts` attempts, miles' backoff between them (`min(2**attempt, 30)` s). Each attempt has
  one deadline, `timeout_secs`, for the whole exchange (miles' `requests` timeout bounds each socket
  read; a reply dribbled byte by byte is cut here). An attempt fails on: no connection, a non-2xx
  status, no reply within the deadline, a reply over `MAX_REPLY` bytes or with a
  `Content-Encoding` (identity is asked for: no decompression bomb), a body that is not JSON.
  Redirects are not followed and no proxy or `.netrc` of the environment is used: the body (it
  holds the gateway's URL) goes to `spec.url` and nowhere else. The last failure raises
  `DelegateFailed` (skip `delegate_failed`) naming the delegate, its URL without credentials or
  query, the attempts and why.
- `raw_metrics(spec, reply)`: the reply's `raw_metrics`, which must be a JSON object, else
  `DelegateFailed` (miles would crash on it).
- `flatten(raw)`: miles' `_flatten_metrics`: every numeric leaf (bools too, as 1.0 / 0.0)
  becomes `eval/<path/joined/by/slash>` (a key already starting with `eval/` is kept), other
  leaves are dropped; non-finite numbers are dropped too (they are not measurements). More than
  `MAX_METRICS` metrics or a key over `MAX_KEY` characters is a ValueError (the caller's
  `DelegateFailed`).
This module imports no Prefect.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx

from pinned_eval.delegate.config import DelegateSpec, shown_url
from pinned_eval.skips import EvalSkipped, SkipReason

__all__ = ["MAX_KEY", "MAX_METRICS", "MAX_REPLY", "DelegateFailed", "flatten", "post", "raw_metrics"]

MAX_REPLY = 16 * 1024 * 1024  # bytes of a delegate's reply
MAX_METRICS = 4096  # numeric leaves of one point's delegate metrics
MAX_KEY = 512  # characters of one metric key


class DelegateFailed(EvalSkipped):
    """A delegate gave no usable answer: the point is skipped `delegate_failed`, naming it."""

    def __init__(self, spec: DelegateSpec, why: str) -> None:
        self.delegate = spec.name
        super().__init__(SkipReason.DELEGATE_FAILED, f"delegate {spec.name!r} ({shown_url(spec.url)}): {why}")


class _AttemptFailed(Exception):
    pass


async def post(spec: DelegateSpec, body: bytes, *, sleep: Any = asyncio.sleep) -> Any:
    """The delegate's parsed JSON reply (see the module docstring)."""
    headers = {"Accept-Encoding": "identity", **spec.headers}
    if not any(k.lower() == "content-type" for k in spec.headers):
        headers["Content-Type"] = "application/json"
    why = ""
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=spec.timeout_secs) as client:
        for attempt in range(1, spec.attempts + 1):
            try:
                async with asyncio.timeout(spec.timeout_secs):
                    return await _attempt(client, spec, body, headers)
            except TimeoutError:
                why = f"no reply within {spec.timeout_secs:g} s"
            except httpx.TimeoutException:
                why = f"no reply within {spec.timeout_secs:g} s"
            except httpx.TransportError as exc:
                why = f"no connection ({type(exc).__name__}: {str(exc)[:200] or 'no detail'})"
            except _AttemptFailed as exc:
                why = str(exc)
            if attempt < spec.attempts:
                await sleep(min(2**attempt, 30))
    raise DelegateFailed(spec, f"{why} (after {spec.attempts} attempt{'s' if spec.attempts > 1 else ''})")


async def _attempt(client: httpx.AsyncClient, spec: DelegateSpec, body: bytes, headers: dict[str, str]) -> Any:
    async with client.stream("POST", spec.url, content=body, headers=headers) as response:
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        raw = bytearray()
        if encoding == "identity":
            async for chunk in response.aiter_raw():
                raw += chunk
                if len(raw) > MAX_REPLY:
                    raise _AttemptFailed(f"reply over {MAX_REPLY} bytes (HTTP {response.status_code})")
        if not 200 <= response.status_code < 300:
            text = raw[:200].decode("utf-8", "replace").replace("\n", " ")
            raise _AttemptFailed(f"HTTP {response.status_code}: {text!r}")
        if encoding != "identity":
            raise _AttemptFailed(f"reply with Content-Encoding {encoding[:40]!r} (identity was asked for)")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _AttemptFailed(f"reply is not JSON: {bytes(raw[:80])!r}") from None


def raw_metrics(spec: DelegateSpec, reply: Any) -> dict[str, Any]:
    """The reply's `raw_metrics` object, or `DelegateFailed` naming what is wrong with the reply."""
    if not isinstance(reply, dict):
        raise DelegateFailed(spec, f"reply is not a JSON object but {type(reply).__name__}")
    if "raw_metrics" not in reply:
        raise DelegateFailed(spec, f"reply has no 'raw_metrics' (keys: {sorted(map(str, reply))[:10]})")
    metrics = reply["raw_metrics"]
    if not isinstance(metrics, dict):
        raise DelegateFailed(spec, f"reply's 'raw_metrics' is not a JSON object but {type(metrics).__name__}")
    return metrics


def flatten(raw: dict[str, Any], *, bounded: bool = True) -> dict[str, float]:
    """miles' metric names and values of `raw` (see the module docstring); with `bounded`, more than
    `MAX_METRICS` metrics or a key over `MAX_KEY` characters raises ValueError."""
    out: dict[str, float] = {}
    stack: list[tuple[str, Any]] = list(reversed(list(raw.items())))
    while stack:  # depth first, in the reply's order, like miles' recursive walk
        key, value = stack.pop()
        if isinstance(value, dict):
            stack.extend(reversed([(f"{key}/{k}", v) for k, v in value.items()]))
            continue
        if not isinstance(value, int | float):
            continue
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float: not a measurement
            continue
        if not math.isfinite(number):
            continue
        name = key if key.startswith("eval/") else f"eval/{key}"
        if bounded and len(name) > MAX_KEY:
            raise ValueError(f"metric key over {MAX_KEY} characters: {name[:80]!r}...")
        out[name] = number
        if bounded and len(out) > MAX_METRICS:
            raise ValueError(f"over {MAX_METRICS} metrics in raw_metrics")
    return out
