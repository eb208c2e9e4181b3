"""Retention of a run's eval-point flow runs: `pinned-eval prune --run R --keep-last N` (no CLI here).

`plan_prune` decides, `apply_prune` deletes. Of the run's points (`flows.point_runs.point_flow_runs`):

- kept whole: the latest `keep_last` steps, every step with a flow run in flight
  (`pinned_eval.inflight.in_flight`), and the steps the staging block keeps as its best K
  (`StagingBlock.protected_steps`, ranked from the ledger of the step's sinks block);
- of any other step, the attempts its newest flow run superseded are deleted, and the newest
  (the step's final record in Prefect) only when the step's rows are in its sinks block's JSONL
  ledger, which `status` and `report` then read the step from. Never a step's final record: a
  step with no ledger row keeps its newest flow run.

Deletion is `POST /flow_runs/bulk_delete` on the planned ids AND a terminal state, 50 a request:
a run that went back in flight since the plan (retried in place) is not deleted. Prefect deletes
a deleted run's states and task runs with it and queues its logs' deletion; its artifacts become
orphans (Prefect's db-vacuum `orphans` removes them). Ledger rows, samples files and staged
snapshots are not touched.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, cast

from pydantic import BaseModel, ConfigDict, Field

from blocks import SinksBlock, StagingBlock
from flows.point_runs import point_flow_runs
from pinned_eval.inflight import TERMINAL, in_flight
from pinned_eval.sinks import Ledger

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.objects import FlowRun

BULK = 50  # Prefect's bulk operation limit


class PruneError(ValueError):
    """The plan cannot be made safely (a block it needs is missing or cannot rank): nothing deleted."""


class Doomed(BaseModel):
    model_config = ConfigDict(frozen=True)

    flow_run_id: str
    step: int
    why: str = Field(description="`superseded` (an older attempt) or `in ledger` (final run, rows kept).")


class PrunePlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    run: str
    keep_last: int
    points: int = Field(description="Flow runs of the run read.")
    last_steps: list[int] = Field(default_factory=list)
    in_flight: list[int] = Field(default_factory=list)
    best_kept: list[int] = Field(default_factory=list)
    only_record: list[int] = Field(default_factory=list, description="Steps whose final run is their only record.")
    delete: list[Doomed] = Field(default_factory=list)

    def lines(self) -> list[str]:
        """What the plan keeps and deletes, in words."""
        steps = sorted({d.step for d in self.delete})
        superseded = sum(d.why == "superseded" for d in self.delete)
        out = [
            f"run {self.run}: {self.points} flow run(s); keeping the last {self.keep_last} step(s)"
            + (f" ({_span(self.last_steps)})" if self.last_steps else ""),
            f"kept: {len(self.in_flight)} step(s) in flight{_list(self.in_flight)}, "
            f"{len(self.best_kept)} best-kept step(s){_list(self.best_kept)}",
        ]
        if self.only_record:
            out.append(f"kept: the final flow run of {len(self.only_record)} step(s) without ledger rows "
                       f"(their only record){_list(self.only_record)}")
        out.append(
            f"delete: {len(self.delete)} flow run(s) of {len(steps)} step(s){_list(steps)}: "
            f"{superseded} superseded attempt(s), {len(self.delete) - superseded} final run(s) whose "
            "rows stay in the JSONL ledger"
        )
        return out


def _span(steps: list[int]) -> str:  # steps in order
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"


def _list(steps: list[int], limit: int = 10) -> str:
    if not steps:
        return ""
    shown = ", ".join(map(str, steps[:limit]))
    return f" ({shown}{', ...' if len(steps) > limit else ''})"


def _created(fr: FlowRun) -> datetime:
    return fr.created or datetime.min.replace(tzinfo=UTC)


def _state(fr: FlowRun) -> str | None:
    return fr.state.type.value if fr.state else None


def _ledger_path(sinks: str) -> str | None:
    try:
        return cast(SinksBlock, SinksBlock.load(sinks)).jsonl_path
    except ValueError:  # no such block: no ledger to keep a step's record
        return None


def _best_kept(run: str, pairs: set[tuple[str, str]]) -> set[int]:
    """The steps each (staging, sinks) block pair of the run's points keeps as its best K."""
    kept: set[int] = set()
    for staging_name, sinks in sorted(pairs):
        try:
            staging = cast(StagingBlock, StagingBlock.load(staging_name))
        except ValueError:
            continue  # no staging block: it keeps no checkpoint
        try:
            kept |= set(staging.protected_steps(run, _ledger_path(sinks)) or ())
        except ValueError as exc:
            raise PruneError(f"staging block {staging_name!r}: {exc}; cannot tell its best-kept steps") from None
    return kept


def plan_prune(client: SyncPrefectClient, run: str, keep_last: int) -> PrunePlan:
    """What `apply_prune` would delete of `run`, keeping its latest `keep_last` steps (module
    docstring). Reads every flow run of the run (paged) and the ledgers; deletes nothing."""
    if keep_last < 1:
        raise PruneError(f"--keep-last: must be at least 1, got {keep_last}")
    runs = point_flow_runs(client, run)
    by_step: dict[int, list[FlowRun]] = defaultdict(list)
    for fr in runs:
        by_step[int(fr.parameters["step"])].append(fr)
    steps = sorted(by_step)
    last = steps[-keep_last:]
    live = sorted(s for s, frs in by_step.items() if any(in_flight(_state(fr)) for fr in frs))
    newest = {s: max(frs, key=_created) for s, frs in by_step.items()}
    sinks_of = {s: str(fr.parameters.get("sinks", "default")) for s, fr in newest.items()}
    pairs = {(str(fr.parameters.get("staging", "default")), sinks_of[s]) for s, fr in newest.items()}
    best = sorted(_best_kept(run, pairs) & set(steps))
    ledgers = {name: _ledger_path(name) for name in set(sinks_of.values())}
    in_ledger: dict[str, set[int]] = {
        path: {row.step for row in Ledger(path).read(run)} for path in {p for p in ledgers.values() if p}
    }
    keep = set(last) | set(live) | set(best)
    doomed: list[Doomed] = []
    only_record: list[int] = []
    for s in steps:
        if s in keep:
            continue
        final = newest[s]
        doomed += [Doomed(flow_run_id=str(fr.id), step=s, why="superseded") for fr in by_step[s] if fr is not final]
        path = ledgers[sinks_of[s]]
        if path is not None and s in in_ledger[path]:
            doomed.append(Doomed(flow_run_id=str(final.id), step=s, why="in ledger"))
        else:
            only_record.append(s)
    return PrunePlan(
        run=run, keep_last=keep_last, points=len(runs), last_steps=last, in_flight=live, best_kept=best,
        only_record=only_record, delete=doomed,
    )  # fmt: skip


def apply_prune(client: SyncPrefectClient, plan: PrunePlan) -> list[str]:
    """Delete the plan's flow runs that are still terminal, `BULK` a request; the ids deleted."""
    ids = [d.flow_run_id for d in plan.delete]
    deleted: list[str] = []
    for i in range(0, len(ids), BULK):
        body = {
            "flow_runs": {"id": {"any_": ids[i : i + BULK]}, "state": {"type": {"any_": sorted(TERMINAL)}}},
            "limit": BULK,
        }
        resp = client.request("POST", "/flow_runs/bulk_delete", json=body)  # type: ignore[arg-type]
        deleted += [str(x) for x in resp.json().get("deleted", [])]
    return deleted
