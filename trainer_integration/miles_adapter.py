"""miles adapter: `--eval-function-path trainer_integration.miles_adapter.PinnedEvalFn` submits each
checkpoint miles exports to pinned-eval and hands miles back miles-shaped results.

Contract:
- `PinnedEvalFn(input)` takes miles' `RolloutFnConstructorInput` (`input.args`, `input.data_source`);
  configuration is `AdapterConfig`: `PINNED_EVAL_MILES_*` variables, overridden by
  `args.pinned_eval_<field>` attributes; the Prefect API URL and credentials default to Prefect's
  own variables (`PREFECT_API_URL`, `PREFECT_API_AUTH_STRING`, `PREFECT_API_KEY`).
- the external posture names a saved `ExternalBackendBlock` (`backend_block`), never a class path.
- `await fn(input)` (miles' `RolloutFnEvalInput`: `rollout_id`, `hf_dir`, `evaluation`) creates
  one flow run of the `eval-point` deployment through the REST API (no Prefect import), with the
  idempotency key uuid5(run, step) — a retried call is the same point — and source kind `hf`
  (miles owns and retires the directory; pinned-eval never deletes it). It polls the flow run to
  a terminal state:
  * Completed → `RolloutFnEvalOutput(data={ds: {"rewards", "truncated", "weight_versions",
    "response_lens", "samples"}}, metrics=...)` (`samples`: `trainer_integration.miles_samples`,
    what `--save-debug-rollout-data` saves), per-sample data read from the point's samples artifact
    (`samples_artifact_key`), metrics from the point's table artifact (dataset-level keys only:
    miles adds its own lag/duration/step);
  * Completed named "Skipped" → raises miles' `EvalSkip(reason)` (`MilesEvalSkip` without miles);
  * Failed / Crashed / Cancelled, or no terminal state within `timeout_s` → `PointFailed`
    (miles records `skipped_crashed`).
  A measured point without a samples artifact raises `SamplesNotRecorded`.
- When miles is importable, the class subclasses miles' `CheckpointEvalFn` (so miles treats it as
  a checkpoint backend) and returns miles' `RolloutFnEvalOutput`; otherwise local look-alikes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from pinned_eval.events import BlockNames
from pinned_eval.external import DatasetResult, results_from_rows, samples_artifact_key
from pinned_eval.inflight import in_flight
from pinned_eval.points import (
    PointRequest,
    Posture,
    RunName,
    SnapshotSource,
    SourceKind,
    flow_run_name,
    history_artifact_key,
    point_event_id,
)
from pinned_eval.polling import PollTimeout, apoll_until
from pinned_eval.settings import PrefectApiSettings
from trainer_integration.miles_samples import miles_samples
from trainer_integration.rest import auth_headers

try:  # pragma: no cover - only where miles is installed
    from miles.rollout.base_types import RolloutFnEvalOutput
    from miles.rollout.checkpoint_eval import CheckpointEvalFn as _MilesBase
    from miles.rollout.checkpoint_eval import EvalSkip as MilesEvalSkip
except ImportError:
    _MilesBase = object

    class MilesEvalSkip(Exception):  # type: ignore[no-redef]
        """miles' `EvalSkip` look-alike: an attributable skip with `.reason`."""

        def __init__(self, reason: str) -> None:
            super().__init__(reason)
            self.reason = reason

    @dataclass
    class RolloutFnEvalOutput:  # type: ignore[no-redef]
        """miles' `RolloutFnEvalOutput` look-alike."""

        data: dict[str, dict[str, Any]]
        metrics: dict[str, Any] | None = None


ENV_PREFIX = "PINNED_EVAL_MILES_"
POINT_KEYS = frozenset({"eval/step", "eval/lag_steps", "eval/duration_seconds", "eval/export_time_seconds"})


class PointFailed(RuntimeError):
    """The point's flow run failed, crashed, was cancelled, or never finished in time."""


class SamplesNotRecorded(RuntimeError):
    """The point measured but published no per-sample results (its posture does not record them)."""


class AdapterConfig(BaseModel):
    """How the adapter reaches pinned-eval and what every point it requests looks like."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_url: str = Field(min_length=1, description="Prefect API URL, e.g. http://127.0.0.1:4200/api.")
    run: RunName = Field(description="pinned-eval run name of this training job.")
    deployment: str = Field(default="eval-point/eval-point", pattern=r"^[^/]+/[^/]+$")
    posture: Posture = Posture.FLEET
    policy: Literal["backpressure", "skip"] = "backpressure"
    max_in_flight: int = Field(default=2, ge=1, le=64)
    blocks: BlockNames = Field(default_factory=BlockNames)
    backend_block: str | None = Field(
        default=None, description="External posture: the saved ExternalBackendBlock the points name."
    )
    require_marker: bool = Field(default=True, description="Require the `.complete` marker in hf_dir.")
    parameters: dict[str, Any] = Field(default_factory=dict, description="Extra flow parameters.")
    poll_interval_s: float = Field(default=2.0, gt=0)
    timeout_s: float = Field(default=6 * 3600.0, gt=0, description="Give up on a point after this long.")
    api_key: SecretStr | None = Field(default=None, description="Bearer token (Prefect Cloud).")
    auth_string: SecretStr | None = Field(default=None, description="user:pass (self-hosted basic auth).")

    @classmethod
    def from_args(cls, args: Any, environ: dict[str, str] | None = None) -> AdapterConfig:
        """Env `PINNED_EVAL_MILES_<FIELD>` (JSON for blocks/parameters), then `args.pinned_eval_<field>`."""
        env = os.environ if environ is None else environ
        prefect = PrefectApiSettings() if environ is None else PrefectApiSettings.from_environ(environ)
        values: dict[str, Any] = {
            "api_url": prefect.api_url,
            "api_key": prefect.api_key,
            "auth_string": prefect.api_auth_string,
        }
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = json.loads(raw) if name in ("blocks", "parameters") else raw
            attr = getattr(args, f"pinned_eval_{name}", None) if args is not None else None
            if attr is not None:
                values[name] = attr
        return cls.model_validate({k: v for k, v in values.items() if v is not None})

    def headers(self) -> dict[str, str]:
        """Authorization as Prefect's client does it (basic auth string wins over a Bearer key)."""
        return auth_headers(PrefectApiSettings.model_construct(api_key=self.api_key, api_auth_string=self.auth_string))


class PointOutcome(BaseModel):
    """A flow run's terminal state as the REST API reports it."""

    flow_run_id: str
    state_type: str
    state_name: str
    message: str | None = None


class _Busy(Exception):
    """The Prefect API is momentarily unavailable (retried)."""


class PinnedEvalREST:
    """The few Prefect REST calls the adapter needs (plain httpx)."""

    def __init__(self, config: AdapterConfig, http: httpx.AsyncClient) -> None:
        self.config = config
        self.http = http
        self.base = config.api_url.rstrip("/")

    async def _json(self, method: str, path: str, body: Any = None) -> Any:
        """One REST call; a busy server (5xx, 429, transport error) is retried briefly — every call
        here is idempotent (reads, and a create with an idempotency key)."""
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(_Busy),
                stop=stop_after_attempt(5),
                wait=wait_exponential(multiplier=0.25, max=4.0),
                reraise=True,
            ):
                with attempt:
                    resp = await self._request(method, path, body)
        except _Busy as exc:
            raise PointFailed(f"Prefect API unavailable: {exc}") from exc
        if resp.status_code >= 400:
            raise PointFailed(f"{method} {path} answered HTTP {resp.status_code}: {resp.text[:500]}")
        return resp.json()

    async def _request(self, method: str, path: str, body: Any) -> httpx.Response:
        try:
            resp = await self.http.request(method, f"{self.base}{path}", json=body, headers=self.config.headers())
        except httpx.TransportError as exc:
            raise _Busy(f"{method} {path}: {exc!r}") from exc
        if resp.status_code >= 500 or resp.status_code == 429:
            raise _Busy(f"{method} {path}: HTTP {resp.status_code}")
        return resp

    async def create_point_run(self, step: int, hf_dir: str) -> str:
        """Create (or find, by idempotency key) the point's flow run; returns its id."""
        cfg = self.config
        request = PointRequest(
            run=cfg.run,
            step=step,
            source=SnapshotSource(kind=SourceKind.HF, path=hf_dir, require_marker=cfg.require_marker),
            posture=cfg.posture,
            policy=cfg.policy,
            max_in_flight=cfg.max_in_flight,
            backend_block=cfg.backend_block,
        )
        parameters = {**request.model_dump(mode="json"), **cfg.blocks.model_dump(), **cfg.parameters}
        deployment = await self._json("GET", f"/deployments/name/{cfg.deployment}")
        run = await self._json(
            "POST",
            f"/deployments/{deployment['id']}/create_flow_run",
            {
                "name": flow_run_name(cfg.run, step),
                "parameters": parameters,
                "tags": [f"run:{cfg.run}", f"step:{step}", "miles"],
                "idempotency_key": str(point_event_id(cfg.run, step)),
            },
        )
        return str(run["id"])

    async def wait(self, flow_run_id: str) -> PointOutcome:
        state: dict[str, Any] = {}

        async def finished() -> PointOutcome | None:
            nonlocal state
            run = await self._json("GET", f"/flow_runs/{flow_run_id}")
            state = run.get("state") or {}
            if in_flight(state.get("type")):
                return None
            return PointOutcome(
                flow_run_id=flow_run_id,
                state_type=state["type"],
                state_name=state.get("name") or state["type"].title(),
                message=state.get("message"),
            )

        try:
            return await apoll_until(
                finished, timeout_s=self.config.timeout_s, interval_s=self.config.poll_interval_s, what=""
            )
        except PollTimeout:
            raise PointFailed(f"flow run {flow_run_id} not finished after {self.config.timeout_s}s ({state})") from None

    async def artifact_data(self, flow_run_id: str, key: str) -> Any | None:
        """Data of the newest artifact `key` of that flow run (None when there is none)."""
        found = await self._json(
            "POST",
            "/artifacts/filter",
            {
                "artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": [key]}},
                "sort": "CREATED_DESC",
                "limit": 1,
            },
        )
        if not found:
            return None
        data = found[0].get("data")
        return json.loads(data) if isinstance(data, str) else data


async def collect_point(rest: PinnedEvalREST, outcome: PointOutcome, step: int) -> RolloutFnEvalOutput:
    """miles-shaped results of a terminal point, or the miles-style exception it maps to."""
    if outcome.state_type == "COMPLETED" and outcome.state_name == "Skipped":
        reason = (outcome.message or "crashed").split(":", 1)[0].strip()
        raise MilesEvalSkip(reason)
    if outcome.state_type != "COMPLETED":
        raise PointFailed(f"eval point {outcome.flow_run_id} ended {outcome.state_name}: {outcome.message}")
    run = rest.config.run
    rows = await rest.artifact_data(outcome.flow_run_id, samples_artifact_key(run, step))
    if rows is None:
        raise SamplesNotRecorded(
            f"eval point {outcome.flow_run_id} ({run}/step-{step}) published no per-sample results "
            f"(artifact {samples_artifact_key(run, step)!r})"
        )
    data: dict[str, DatasetResult] = results_from_rows(rows)
    table = await rest.artifact_data(outcome.flow_run_id, f"{history_artifact_key(run)}-step-{step}") or []
    metrics: dict[str, float] = {}
    for row in table:
        metrics.update(
            {
                k: v
                for k, v in row.items()
                if k.startswith("eval/") and k not in POINT_KEYS and isinstance(v, int | float)
            }
        )
    out = {ds: {**res.to_miles(), "samples": miles_samples(res)} for ds, res in data.items()}
    return RolloutFnEvalOutput(data=out, metrics=metrics)


class PinnedEvalFn(_MilesBase):
    """miles `--eval-function-path` target: each checkpoint becomes one pinned-eval point."""

    def __init__(self, input: Any) -> None:
        self.args = getattr(input, "args", None)
        self.config = AdapterConfig.from_args(self.args)

    async def __call__(self, input: Any) -> RolloutFnEvalOutput:
        if not getattr(input, "evaluation", False):
            raise ValueError("PinnedEvalFn only serves eval; keep the train fn on --rollout-function-path")
        if getattr(input, "hf_dir", None) is None:
            raise ValueError("no snapshot was dispatched: pinned-eval needs miles' snapshot posture (hf_dir)")
        return await self.evaluate_checkpoint(input.hf_dir, input)

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: Any) -> RolloutFnEvalOutput:
        step = int(input.rollout_id)
        async with httpx.AsyncClient(timeout=60.0) as http:
            rest = PinnedEvalREST(self.config, http)
            flow_run_id = await rest.create_point_run(step, checkpoint_dir)
            outcome = await rest.wait(flow_run_id)
            return await collect_point(rest, outcome, step)

    def dispose(self) -> None:
        """Nothing to tear down: the points live in pinned-eval."""
