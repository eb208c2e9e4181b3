"""The few Prefect REST calls the trainer side makes, over plain httpx (no Prefect import).

Contract: every call goes through one `httpx.Client` built by `api_client` with the auth of
`pinned_eval.settings.PrefectApiSettings` (basic `PREFECT_API_AUTH_STRING`, else the string in the
file `PINNED_EVAL_API_AUTH_FILE`, wins over Bearer `PREFECT_API_KEY`, as in Prefect's own client).
Reads raise `ApiUnavailableError` when the API cannot be reached or answers 5xx, so callers can
degrade (admit and spool) instead of failing; other HTTP errors (a 401 included) raise
`httpx.HTTPStatusError`.

A run's point flow runs and which are in flight are defined once, in `pinned_eval.inflight`
(one query, matched on the `run` parameter); `point_runs` sends that query (the whole history,
paged), `point_runs_changed` the incremental one (what can be in flight or changed since a time);
both return the server's clock at the first page (its `Date` header) for the next `since`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from pinned_eval.inflight import (
    POINT_FLOW,
    changed_runs_filter,
    in_flight,
    is_point_of,
    is_step_point,
    point_runs_filter,
    steps_runs_filter,
)
from pinned_eval.settings import PrefectApiSettings

_PAGE = 200


_ATTEMPTS = 4  # a busy server (SQLite locked → 503) usually answers within a second or two


class ApiUnavailableError(RuntimeError):
    """The Prefect API could not be reached, or answered with a server error."""


class PointRun(BaseModel):
    """What the trainer needs of one eval-point flow run."""

    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    step: int
    state_type: str
    state_name: str
    message: str | None
    created: str

    @property
    def terminal(self) -> bool:
        return not in_flight(self.state_type)


def auth_headers(settings: PrefectApiSettings) -> dict[str, str]:
    """Authorization header for the API (or a Cloud webhook) from Prefect's env variables (or
    `PINNED_EVAL_API_AUTH_FILE`)."""
    return settings.auth_headers()


def api_client(
    settings: PrefectApiSettings, *, timeout_s: float = 5.0, transport: httpx.BaseTransport | None = None
) -> httpx.Client:
    return httpx.Client(headers=auth_headers(settings), timeout=timeout_s, transport=transport)


class PrefectRest:
    def __init__(self, api_url: str, http: httpx.Client, *, flow_name: str = POINT_FLOW) -> None:
        self.api = api_url.rstrip("/")
        self.http = http
        self.flow_name = flow_name

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One API call, retried briefly while the server is busy (every call made here is
        idempotent: reads, event ids, idempotency keys, upserts); then `ApiUnavailableError`."""
        for attempt in Retrying(
            retry=retry_if_exception_type(ApiUnavailableError),
            stop=stop_after_attempt(_ATTEMPTS),
            wait=wait_exponential(multiplier=0.25, max=2.0),
            reraise=True,
        ):
            with attempt:
                return self._call_once(method, path, **kwargs)
        raise AssertionError("unreachable")  # Retrying re-raises the last error

    def _call_once(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self.http.request(method, f"{self.api}{path}", **kwargs)
        except httpx.TransportError as exc:
            raise ApiUnavailableError(f"{method} {path}: {exc!r}") from exc
        if resp.status_code >= 500 or resp.status_code == 429:
            raise ApiUnavailableError(f"{method} {path}: HTTP {resp.status_code}")
        return resp

    # ---- flow runs ---------------------------------------------------------------------------

    def _filter(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], datetime | None]:
        """Every page of `POST /flow_runs/filter`, and the server's time at the first (None when
        it sent no usable `Date` header)."""
        out: list[dict[str, Any]] = []
        offset = 0
        at: datetime | None = None
        while True:
            resp = self._call("POST", "/flow_runs/filter", json={**body, "limit": _PAGE, "offset": offset})
            resp.raise_for_status()
            if offset == 0:
                at = _server_time(resp)
            page = resp.json()
            out.extend(page)
            if len(page) < _PAGE:
                return out, at
            offset += _PAGE

    def _points(self, body: dict[str, Any], run: str) -> list[PointRun]:
        raw, _ = self._filter(body)
        return self._sorted(raw, run)

    @staticmethod
    def _sorted(raw: list[dict[str, Any]], run: str) -> list[PointRun]:
        runs = [_point_run(r) for r in raw if is_point_of(r.get("parameters"), run)]
        return sorted(runs, key=lambda r: (r.created, r.id))

    def point_runs(self, run: str) -> list[PointRun]:
        """Flow runs of `run`'s eval points, oldest first (`pinned_eval.inflight` defines which)."""
        return self._points(point_runs_filter(run, self.flow_name), run)

    def point_runs_at(self, run: str) -> tuple[list[PointRun], datetime | None]:
        """`point_runs(run)` and the server's time when it answered (None if it did not say)."""
        raw, at = self._filter(point_runs_filter(run, self.flow_name))
        return self._sorted(raw, run), at

    def step_point_runs(self, run: str, steps: list[int]) -> list[PointRun]:
        """The point flow runs of `run` at `steps` (those `point_runs` holds for them), oldest
        first: one request per 200 steps (`pinned_eval.inflight.steps_runs_filter`), not the history."""
        out: list[dict[str, Any]] = []
        wanted = sorted(set(steps))
        for i in range(0, len(wanted), _PAGE):
            chunk = wanted[i : i + _PAGE]
            raw, _ = self._filter(steps_runs_filter(run, chunk, self.flow_name))
            out += [r for r in raw if is_step_point(
                r.get("parameters"), r.get("tags"), (r.get("state") or {}).get("type"), run, set(chunk))]
        return self._sorted(out, run)

    def point_runs_changed(
        self, run: str, since: datetime, unseen: list[int]
    ) -> tuple[list[PointRun], datetime | None]:
        """`run`'s point flow runs that are not terminal, ended at or after `since`, or are named
        after a step in `unseen` (`pinned_eval.inflight.changed_runs_filter`), oldest first; and
        the server's time when it answered."""
        body = changed_runs_filter(run, since.isoformat(), unseen, self.flow_name)
        raw, at = self._filter(body)
        return self._sorted(raw, run), at

    def post_events(self, events: list[dict[str, Any]]) -> httpx.Response:
        """`POST /events` (204 on success; the server de-duplicates by event id)."""
        return self._call("POST", "/events", json=events)

    def deployment_id(self, flow_name: str, deployment_name: str) -> str:
        resp = self._call("GET", f"/deployments/name/{flow_name}/{deployment_name}")
        resp.raise_for_status()
        return str(resp.json()["id"])

    def create_flow_run(self, deployment_id: str, body: dict[str, Any]) -> httpx.Response:
        return self._call("POST", f"/deployments/{deployment_id}/create_flow_run", json=body)

    # ---- variables and blocks ----------------------------------------------------------------

    def set_variable(self, name: str, value: Any) -> None:
        """Create or update the Variable `name`."""
        resp = self._call("PATCH", f"/variables/name/{name}", json={"value": value})
        if resp.status_code == 404:
            resp = self._call("POST", "/variables/", json={"name": name, "value": value})
            if resp.status_code == 409:  # created meanwhile by another writer
                resp = self._call("PATCH", f"/variables/name/{name}", json={"value": value})
        resp.raise_for_status()

    def get_variable(self, name: str) -> Any:
        resp = self._call("GET", f"/variables/name/{name}")
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return resp.json()["value"]

    def block_data(self, slug: str, name: str, *, include_secrets: bool = False) -> dict[str, Any] | None:
        """A saved block's fields (secret ones in clear only with `include_secrets`), or None."""
        params = {"include_secrets": "true"} if include_secrets else None
        resp = self._call("GET", f"/block_types/slug/{slug}/block_documents/name/{name}", params=params)
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return dict(resp.json()["data"])


def _server_time(resp: httpx.Response) -> datetime | None:
    try:
        return parsedate_to_datetime(resp.headers["date"]).astimezone(UTC)
    except (KeyError, TypeError, ValueError):
        return None


def _point_run(raw: dict[str, Any]) -> PointRun:
    state = raw.get("state") or {}
    return PointRun(
        id=str(raw["id"]),
        name=raw["name"],
        step=int(raw["parameters"]["step"]),
        state_type=state.get("type") or "SCHEDULED",
        state_name=state.get("name") or "",
        message=state.get("message"),
        created=raw["created"],
    )
