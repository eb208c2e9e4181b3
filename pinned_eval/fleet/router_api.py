"""sglang-router (0.3.2, the "smg" gateway) membership and readiness.

Contract (protocol reference §4):
- Membership is `GET /workers`, `POST /workers {"url"}` (202, processed in the background) and
  `DELETE /workers/{id}` (202). `add_worker` returns only once the worker is listed and healthy;
  `remove_worker` only once it is no longer listed. Legacy `/add_worker` and `/list_workers` are
  gone in 0.3.2 and are not used.
- Readiness is a 1-token `/generate` through the router answered 200 (miles `_wait_router_ready`):
  `/readiness` alone says nothing about whether a request actually reaches a worker.
- The router is data plane only: no weight loads or version reads go through it.
"""

from __future__ import annotations

import asyncio

import httpx

from pinned_eval.fleet.engine_api import bearer
from pinned_eval.fleet.errors import EngineHTTPError, RouterError
from pinned_eval.fleet.models import RouterWorker, normalize_url
from pinned_eval.polling import PollTimeout, apoll_until

READINESS_PROBE = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}


class RouterAPI:
    def __init__(
        self,
        http: httpx.AsyncClient,
        router_url: str,
        *,
        api_key: str | None = None,
        poll_interval_s: float = 0.25,
        call_timeout_s: float = 30.0,
    ) -> None:
        self._http = http
        self.url = normalize_url(router_url)
        self._headers = bearer(api_key)
        self.poll_interval_s = poll_interval_s
        self.call_timeout_s = call_timeout_s

    async def list_workers(self) -> list[RouterWorker]:
        resp = await self._http.get(f"{self.url}/workers", headers=self._headers, timeout=self.call_timeout_s)
        if resp.status_code != 200:
            raise EngineHTTPError(self.url, resp.status_code, resp.text)
        body = resp.json()
        if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
            raise EngineHTTPError(self.url, resp.status_code, f"`workers` list missing: {resp.text[:300]}")
        return [RouterWorker.model_validate(w) for w in body["workers"]]

    async def add_worker(self, url: str, *, timeout_s: float = 60.0) -> RouterWorker:
        """Register `url` and wait until the router lists it as healthy.

        A URL already listed is not posted again: the router would queue a job that could re-create
        the worker after a later DELETE.
        """
        url = normalize_url(url)
        listed = [w for w in await self.list_workers() if w.url == url]
        if listed:
            return await self._wait_healthy(url, timeout_s)
        resp = await self._http.post(
            f"{self.url}/workers", json={"url": url}, headers=self._headers, timeout=self.call_timeout_s
        )
        if resp.status_code not in (200, 201, 202):
            raise EngineHTTPError(self.url, resp.status_code, resp.text)
        return await self._wait_healthy(url, timeout_s)

    async def _wait_healthy(self, url: str, timeout_s: float) -> RouterWorker:
        state = "not listed"

        async def healthy() -> RouterWorker | None:
            nonlocal state
            listed = [w for w in await self.list_workers() if w.url == url]
            state = "listed but unhealthy" if listed else "not listed"
            return listed[0] if listed and listed[0].is_healthy else None

        try:
            return await apoll_until(healthy, timeout_s=timeout_s, interval_s=self.poll_interval_s, what="")
        except PollTimeout:
            raise RouterError(f"router {self.url}: worker {url} {state} after {timeout_s}s") from None

    async def remove_worker(self, url: str, *, timeout_s: float = 30.0) -> bool:
        """Deregister `url`; False when it was not a member. Waits until it is no longer listed."""
        url = normalize_url(url)
        ids = [w.id for w in await self.list_workers() if w.url == url]
        for worker_id in ids:
            resp = await self._http.delete(
                f"{self.url}/workers/{worker_id}", headers=self._headers, timeout=self.call_timeout_s
            )
            if resp.status_code not in (200, 202, 204, 404):
                raise EngineHTTPError(self.url, resp.status_code, resp.text)
        if not ids:
            return False

        async def gone() -> bool:
            return not any(w.url == url for w in await self.list_workers())

        try:
            await apoll_until(gone, timeout_s=timeout_s, interval_s=self.poll_interval_s, what="")
        except PollTimeout:
            raise RouterError(f"router {self.url}: worker {url} still listed {timeout_s}s after DELETE") from None
        return True

    async def sync_workers(self, urls: list[str], *, timeout_s: float = 60.0) -> list[str]:
        """Make the membership exactly `urls` (add missing, remove every other worker); return it."""
        wanted = [normalize_url(u) for u in urls]
        current = {w.url for w in await self.list_workers()}
        for stray in sorted(current - set(wanted)):
            await self.remove_worker(stray, timeout_s=timeout_s)
        await asyncio.gather(*(self.add_worker(u, timeout_s=timeout_s) for u in wanted))  # listed ones: a wait
        return sorted(w.url for w in await self.list_workers())

    async def wait_ready(self, *, timeout_s: float = 180.0, retry_interval_s: float = 1.0) -> None:
        """Probe a 1-token generate through the router until it answers 200."""
        last = "no attempt"

        async def answers() -> bool:
            nonlocal last
            try:
                resp = await self._http.post(
                    f"{self.url}/generate",
                    json=READINESS_PROBE,
                    headers=self._headers,
                    timeout=min(60.0, max(1.0, timeout_s)),
                )
            except httpx.TransportError as exc:
                last = repr(exc)
                return False
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            return resp.status_code == 200

        try:
            await apoll_until(answers, timeout_s=timeout_s, interval_s=retry_interval_s, what="")
        except PollTimeout:
            raise RouterError(f"router {self.url} not ready after {timeout_s}s: {last}") from None
