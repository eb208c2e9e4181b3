"""The history of a training run's eval points, read back from Prefect (no CLI here).

Sources: every `eval-point` flow run of the run (`flows.point_runs`, as `pinned_eval.inflight`
defines them: tagged `run:<run>`, plus runs not terminal yet, untagged ones included), each run's
state history, and the metric rows — from the JSONL sink when the point's sinks block has a path,
else from the per-point table artifact `eval-<run>-step-<step>`.

Invariants:
- one `PointHistory` per step; the latest flow run of the step (by creation time) decides its
  state, and every attempt is kept: a run retried in place (same id, `run_count + 1`) contributes
  one `Attempt` per terminal state it went through, a rerun as a new flow run contributes its own;
- scores come only from `measured` rows; a step with rows but no flow run (a trainer-side skip)
  is still listed, its state taken from the rows;
- `build_history` is pure (hand-built inputs in tests); `read_history` does the reading.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Collection
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from prefect import get_client
from pydantic import BaseModel, ConfigDict, Field

from blocks import SinksBlock
from flows.point_runs import point_flow_runs, recent_point_flow_runs, step_point_flow_runs
from pinned_eval.inflight import TERMINAL
from pinned_eval.points import Outcome, history_artifact_key, outcome_of, reason_of
from pinned_eval.sinks import Ledger, MetricRow

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.objects import FlowRun, State


_ARTIFACT_PAGE = 200


class Attempt(BaseModel):
    """One try of a point: from a start to the terminal state that ended it (or still going)."""

    model_config = ConfigDict(frozen=True)

    flow_run_id: str
    number: int = Field(ge=1, description="1-based count over all attempts of the step.")
    state_type: str
    state_name: str
    message: str | None = None
    started: datetime | None = None
    ended: datetime | None = None

    @property
    def outcome(self) -> Outcome:
        return outcome_of(self.state_type, self.state_name)


class FlowRunRecord(BaseModel):
    """What this module reads of one `eval-point` flow run."""

    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    run: str
    step: int
    parameters: dict[str, Any] = Field(default_factory=dict)
    deployment_id: str | None = None
    state_type: str
    state_name: str
    message: str | None = None
    created: datetime
    start_time: datetime | None = None
    end_time: datetime | None = None
    run_count: int = 0
    states: list[tuple[str, str, str | None, datetime]] = Field(
        default_factory=list, description="(type, name, message, timestamp), oldest first."
    )

    @classmethod
    def from_prefect(cls, fr: FlowRun, states: list[State] | None = None) -> FlowRunRecord:
        state = fr.state
        return cls(
            id=str(fr.id),
            name=fr.name,
            run=str(fr.parameters["run"]),
            step=int(fr.parameters["step"]),
            parameters=dict(fr.parameters),
            deployment_id=str(fr.deployment_id) if fr.deployment_id else None,
            state_type=state.type.value if state else "PENDING",
            state_name=(state.name or state.type.value.title()) if state else "Pending",
            message=state.message if state else None,
            created=fr.created or fr.expected_start_time or datetime.now(UTC),
            start_time=fr.start_time,
            end_time=fr.end_time,
            run_count=fr.run_count,
            states=sorted(
                ((s.type.value, s.name or s.type.value.title(), s.message, s.timestamp) for s in (states or [])),
                key=lambda s: s[3],
            ),
        )

    def attempts(self) -> list[tuple[str, str, str | None, datetime | None, datetime | None]]:
        """(type, name, message, started, ended) per attempt: every terminal state closes one."""
        if not self.states:
            return [(self.state_type, self.state_name, self.message, self.start_time, self.end_time)]
        out: list[tuple[str, str, str | None, datetime | None, datetime | None]] = []
        started: datetime | None = None
        last: tuple[str, str, str | None, datetime] | None = None
        for kind, name, message, ts in self.states:
            if kind == "RUNNING" and started is None:
                started = ts
            last = (kind, name, message, ts)
            if kind in TERMINAL:
                out.append((kind, name, message, started, ts))
                started = None
        if last is not None and last[0] not in TERMINAL:
            out.append((last[0], last[1], last[2], started, None))
        return out


class PointHistory(BaseModel):
    """A step's record: its latest flow run's outcome, scores per dataset, and every attempt."""

    model_config = ConfigDict(frozen=True)

    run: str
    step: int
    outcome: Outcome
    state_type: str | None = None
    state_name: str | None = None
    reason: str | None = None
    message: str | None = None
    weight_version: str | None = None
    scores: dict[str, float] = Field(default_factory=dict, description="eval/<ds> mean reward per dataset.")
    lag_steps: float | None = None
    flow_run_id: str | None = None
    flow_run_name: str | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None
    attempts: list[Attempt] = Field(default_factory=list)


class RunHistory(BaseModel):
    model_config = ConfigDict(frozen=True)

    run: str
    points: list[PointHistory] = Field(default_factory=list, description="One per step, by step.")

    @property
    def datasets(self) -> list[str]:
        return sorted({ds for p in self.points for ds in p.scores})

    def point(self, step: int) -> PointHistory | None:
        return next((p for p in self.points if p.step == step), None)


def build_history(run: str, records: list[FlowRunRecord], rows: list[MetricRow]) -> RunHistory:
    """Merge flow runs and metric rows of `run` into one history (pure)."""
    runs_by_step: dict[int, list[FlowRunRecord]] = defaultdict(list)
    for rec in records:
        if rec.run == run:
            runs_by_step[rec.step].append(rec)
    rows_by_step: dict[int, list[MetricRow]] = defaultdict(list)
    for row in rows:
        if row.run == run:
            rows_by_step[row.step].append(row)
    points = [
        _point(run, step, sorted(runs_by_step.get(step, []), key=lambda r: r.created), rows_by_step.get(step, []))
        for step in sorted(set(runs_by_step) | set(rows_by_step))
    ]
    return RunHistory(run=run, points=points)


def _point(run: str, step: int, runs: list[FlowRunRecord], rows: list[MetricRow]) -> PointHistory:
    measured = [r for r in rows if r.state == "measured" and r.dataset is not None]
    scores = {ds: r.metrics[f"eval/{ds}"] for r in measured if (ds := r.dataset) and f"eval/{ds}" in r.metrics}
    lag = next((r.metrics["eval/lag_steps"] for r in rows if "eval/lag_steps" in r.metrics), None)
    version = next((r.weight_version for r in measured if r.weight_version), None)
    attempts = [
        Attempt(flow_run_id=rec.id, number=1, state_type=k, state_name=n, message=m, started=s, ended=e)
        for rec in runs
        for (k, n, m, s, e) in rec.attempts()
    ]
    attempts = [a.model_copy(update={"number": i}) for i, a in enumerate(attempts, 1)]
    if not runs:  # recorded without a flow run (e.g. a trainer-side busy skip)
        row = rows[0]
        outcome: Outcome = "measured" if measured else ("skipped" if row.state == "skipped" else "failed")
        return PointHistory(
            run=run, step=step, outcome=outcome, reason=row.reason, weight_version=version,
            scores=scores, lag_steps=lag,
        )
    last = runs[-1]
    outcome = outcome_of(last.state_type, last.state_name)
    reason = reason_of(outcome, last.message)
    if outcome in ("skipped", "failed", "crashed"):
        reason = next((r.reason for r in rows if r.reason), None) or reason
    return PointHistory(
        run=run,
        step=step,
        outcome=outcome,
        state_type=last.state_type,
        state_name=last.state_name,
        reason=reason,
        message=last.message,
        weight_version=version if outcome == "measured" else None,
        scores=scores if outcome == "measured" else {},
        lag_steps=lag,
        flow_run_id=last.id,
        flow_run_name=last.name,
        start_time=last.start_time,
        end_time=last.end_time,
        attempts=attempts,
    )


# ---- reading from Prefect ------------------------------------------------------------------------


def _artifact_rows(client: SyncPrefectClient, run: str, steps: list[int]) -> list[MetricRow]:
    """The rows of the per-point table artifacts of `steps`, the latest of each key, read in
    pages of up to 200 keys (one request per page, not per step)."""
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    prefix = history_artifact_key(run)
    rows: list[MetricRow] = []
    for i in range(0, len(steps), _ARTIFACT_PAGE):
        keys = {f"{prefix}-step-{s}": s for s in steps[i : i + _ARTIFACT_PAGE]}
        found = client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=list(keys))),
            limit=len(keys),
        )
        for art in found:
            if art.key in keys and art.data:
                rows.extend(_table_rows(run, keys[art.key], art.data))
    return rows


def _table_rows(run: str, step: int, data: Any) -> list[MetricRow]:
    table = cast("list[dict[str, Any]]", json.loads(data) if isinstance(data, str) else data)
    return [
        MetricRow(
            run=run,
            step=step,
            dataset=r.get("dataset") or None,
            state=r["state"],
            reason=r.get("reason") or None,
            weight_version=str(step) if r["state"] == "measured" else None,
            metrics={k: float(v) for k, v in r.items() if k.startswith("eval/") and isinstance(v, int | float)},
        )
        for r in table
    ]


def _may_have_attempts(fr: FlowRun) -> bool:
    """Whether a flow run may have gone through more than one attempt (retried in place): only
    then is its state history read; otherwise its embedded state is its one attempt."""
    state = fr.state.type.value if fr.state else None
    return fr.run_count > 1 or (fr.run_count >= 1 and state in ("SCHEDULED", "PENDING"))


def _jsonl_path(sinks_name: str) -> str | None:
    try:
        return cast(SinksBlock, SinksBlock.load(sinks_name)).jsonl_path
    except ValueError:  # the block was deleted: fall back to the artifacts
        return None


def newest_point_sinks(client: SyncPrefectClient, run: str) -> str | None:
    """The sinks block the run's newest point names (`default` when it names none); None when
    the run has no point. One request."""
    runs = recent_point_flow_runs(client, run, last=1)
    newest = max(runs, key=lambda fr: fr.created or datetime.min.replace(tzinfo=UTC), default=None)
    return str(newest.parameters.get("sinks", "default")) if newest is not None else None


def read_history(
    run: str,
    *,
    client: SyncPrefectClient | None = None,
    last: int | None = None,
    since: int | None = None,
    steps: Collection[int] | None = None,
) -> RunHistory:
    """The history of `run` as Prefect (and the run's JSONL sink) record it now: every step, or
    (`last` / `since`) the latest `last` steps at or after step `since` (`recent_point_flow_runs`),
    or (`steps`) those steps only (`step_point_flow_runs`: one request per 200 steps).

    API cost: the flow-run pages (states come embedded; a run's state history is read only when
    it may hold several attempts, `_may_have_attempts`) and one artifact page per 200 steps
    without JSONL rows, never one request per point."""

    if client is None:
        with get_client(sync_client=True) as c:
            return read_history(run, client=c, last=last, since=since, steps=steps)
    if steps is not None:
        flow_runs = step_point_flow_runs(client, run, steps)
    elif last is None and since is None:
        flow_runs = point_flow_runs(client, run)
    else:
        flow_runs = recent_point_flow_runs(client, run, last=last, since=since)
    records = [
        FlowRunRecord.from_prefect(fr, client.read_flow_run_states(fr.id) if _may_have_attempts(fr) else None)
        for fr in flow_runs
    ]
    by_age = sorted(records, key=lambda r: r.created)
    sinks_of_step = {r.step: str(r.parameters.get("sinks", "default")) for r in by_age}
    paths = {name: _jsonl_path(name) for name in set(sinks_of_step.values()) | {"default"}}
    low: int | None = None
    if last is not None or since is not None:  # leave out the JSONL rows of steps below the window
        lows = [since] if since is not None else []
        lows += [min(sinks_of_step)] if last is not None and sinks_of_step else []
        low = max(lows, default=None)
    wanted = set(steps) if steps is not None else None
    jsonl_rows = [
        row for p in {p for p in paths.values() if p} for row in Ledger(p).read(run, steps=wanted, min_step=low)
    ]
    rows_by_step: dict[int, list[MetricRow]] = defaultdict(list)
    for row in jsonl_rows:
        rows_by_step[row.step].append(row)
    rows: list[MetricRow] = [r for rs in rows_by_step.values() for r in rs]
    missing = [s for s, name in sinks_of_step.items() if not paths.get(name) and s not in rows_by_step]
    rows.extend(_artifact_rows(client, run, sorted(missing)))
    return build_history(run, records, rows)
