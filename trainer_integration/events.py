"""What the trainer sends to the orchestrator, and how one spooled request is delivered.

Three kinds of request, all idempotent on the receiver:
- `event`: a point request. With `direct_runs` (the default without a webhook) it is delivered as
  the point's flow run created directly on the deployment (`POST /deployments/{id}/create_flow_run`,
  idempotency key = the event id, named and tagged like a skip record), which skips the trigger
  service; only when that is refused for good (no such deployment, a 4xx) is the event itself
  sent, so one (run, step) never gets both. The event is `pinned-eval.point.requested` on
  resource `pinned-eval.run.<run>` with id uuid5(run, step) (`pinned_eval.events.point_event`),
  posted to OSS `POST /api/events` as a one-element list, or to a Prefect Cloud webhook as the
  JSON body (the webhook's template in `docs/cloud-webhook.md` renders the same event from it);
- `skip_record`: a point the trainer itself decided not to run (`busy` at the in-flight bound
  under `skip`, or `export_failed` of an in-loop export). It becomes a flow run of the eval-point
  deployment created directly in the final state Completed named "Skipped" with message
  `"<reason>: ..."`, named `<run>/step-<step>` and tagged `run:<run>`, `step:<step>` (idempotency
  key derived from the event id), plus the `eval/skipped_<reason>` row in the JSONL sink named by
  the point's sinks block when that file is reachable from here.

- `run_request`: the point's run created directly on the deployment (idempotency key = the event
  id) when an accepted event never became a run within the client's `visible_timeout_s`.

`Delivery.__call__` maps outcomes for the spool: unreachable / 5xx / 408 / 429 / 401 / 403 →
`TransientDeliveryError` (kept, retried in order); other 4xx → `RejectedDeliveryError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pinned_eval.events import BlockNames, point_event
from pinned_eval.points import PointRequest, flow_run_name, point_event_id
from pinned_eval.scoring.metrics import skip_metrics
from pinned_eval.sinks import Ledger, MetricRow
from trainer_integration.rest import ApiUnavailableError, PrefectRest
from trainer_integration.spool import RejectedDeliveryError, SpoolEntry, TransientDeliveryError

log = logging.getLogger(__name__)

SINKS_BLOCK_SLUG = "pinned-eval-sinks"
STAGING_BLOCK_SLUG = "pinned-eval-staging"
_TRANSIENT_4XX = {401, 403, 408, 429}


def event_entry(request: PointRequest, blocks: BlockNames) -> SpoolEntry:
    event = point_event(request, blocks)
    return SpoolEntry(kind="event", run=request.run, step=request.step, key=event["id"], body=event)


def direct_run_body(event: dict[str, Any]) -> dict[str, Any]:
    """The flow-run body that creates the point of `event` on the deployment (the parameters the
    trigger would render from it; idempotency key = the event id)."""
    payload = dict(event["payload"])
    blocks = payload.pop("blocks")
    params = {**payload, **blocks}
    run, step = payload["run"], payload["step"]
    return {
        "name": flow_run_name(run, step),
        "parameters": params,
        "tags": [f"run:{run}", f"step:{step}"],
        "idempotency_key": event["id"],
    }


def run_request_entry(request: PointRequest, blocks: BlockNames) -> SpoolEntry:
    """The point's flow run created directly on the deployment (same parameters as the event's
    trigger would pass, idempotency key = the event id): the fallback when an accepted event never
    became a run (e.g. the server stopped before its trigger fired)."""
    params = request.model_dump(mode="json")
    params.update(blocks.model_dump())
    key = str(point_event_id(request.run, request.step))
    body = {
        "name": flow_run_name(request.run, request.step),
        "parameters": params,
        "tags": [f"run:{request.run}", f"step:{request.step}"],
        "idempotency_key": key,
    }
    return SpoolEntry(kind="run_request", run=request.run, step=request.step, key=f"run:{key}", body=body)


def skip_record_entry(request: PointRequest, blocks: BlockNames, reason: str, message: str) -> SpoolEntry:
    """A Completed/"Skipped" flow run for a point the trainer skipped itself."""
    params = request.model_dump(mode="json")
    params.update(blocks.model_dump())
    key = f"pinned-eval-skip:{point_event_id(request.run, request.step)}"
    body = {
        "name": flow_run_name(request.run, request.step),
        "parameters": params,
        "tags": [f"run:{request.run}", f"step:{request.step}"],
        "state": {"type": "COMPLETED", "name": "Skipped", "message": f"{reason}: {message}"},
        "idempotency_key": key,
    }
    return SpoolEntry(kind="skip_record", run=request.run, step=request.step, key=key, body=body)


def _check(resp: httpx.Response, what: str) -> None:
    if resp.is_success:
        return
    detail = f"{what}: HTTP {resp.status_code} {resp.text[:300]}"
    if resp.status_code >= 500 or resp.status_code in _TRANSIENT_4XX:
        raise TransientDeliveryError(detail)
    raise RejectedDeliveryError(detail)


class Delivery:
    """Delivers one spool entry; the spool's deliverer calls it from its thread."""

    def __init__(
        self,
        rest: PrefectRest,
        *,
        webhook_url: str | None = None,
        deployment: str = "eval-point/eval-point",
        latest_step: Callable[[], int | None] = lambda: None,
        direct_runs: bool = False,
    ) -> None:
        self.rest = rest
        self.direct_runs = direct_runs
        self.webhook_url = webhook_url
        self.deployment = deployment
        self.latest_step = latest_step
        self._deployment_id: str | None = None

    def __call__(self, entry: SpoolEntry) -> None:
        try:
            if entry.kind == "event" and self.direct_runs:
                self._direct_or_event(entry)
            elif entry.kind == "event":
                self._send_event(entry.body)
            elif entry.kind == "run_request":
                self._create_run(entry)
            else:
                self._create_run(entry)
                self._write_sink_row(entry)
        except (ApiUnavailableError, httpx.TransportError) as exc:
            raise TransientDeliveryError(str(exc)) from exc

    def _direct_or_event(self, entry: SpoolEntry) -> None:
        """Create the point's run directly; a transient failure is retried as is (the key makes a
        lost 2xx harmless), a permanent refusal falls back to the event (no run was created)."""
        try:
            body = direct_run_body(entry.body)
            self._create_run(entry.model_copy(update={"body": body}))
        except RejectedDeliveryError as exc:
            log.warning("pinned-eval: direct run for %s step %d refused (%s); sending the event", entry.run,
                        entry.step, exc)
            self._send_event(entry.body)

    def _send_event(self, event: dict[str, Any]) -> None:
        if self.webhook_url:
            resp = self.rest.http.post(self.webhook_url, json=event)
            _check(resp, f"webhook {event['event']}")
        else:
            resp = self.rest.post_events([event])
            _check(resp, f"POST /events {event['event']}")

    def _create_run(self, entry: SpoolEntry) -> None:
        if self._deployment_id is None:
            flow, name = self.deployment.split("/", 1)
            try:
                self._deployment_id = self.rest.deployment_id(flow, name)
            except httpx.HTTPStatusError as exc:
                _check(exc.response, f"deployment {self.deployment}")
        resp = self.rest.create_flow_run(str(self._deployment_id), entry.body)
        _check(resp, f"{entry.kind} {entry.body['name']}")

    def _write_sink_row(self, entry: SpoolEntry) -> None:
        sinks = self.rest.block_data(SINKS_BLOCK_SLUG, entry.body["parameters"]["sinks"])
        path = (sinks or {}).get("jsonl_path")
        if not path or not Path(path).parent.is_dir():
            log.info("pinned-eval: skip %s recorded in Prefect; JSONL sink not reachable here", entry.key)
            return
        reason = entry.body["state"]["message"].split(":", 1)[0]
        latest = self.latest_step()
        lag = max(latest - entry.step, 0) if latest is not None else 0
        row = MetricRow(
            run=entry.run,
            step=entry.step,
            state="skipped",
            reason=reason,
            metrics={**skip_metrics(entry.step, reason), "eval/lag_steps": float(lag)},
        )
        Ledger(path).write_point([row])
