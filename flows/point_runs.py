"""A run's eval-point flow runs read with Prefect's client: the query of `pinned_eval.inflight`.

Used by the janitor flow and by the app's history and operator commands, so every reader (and
the trainer side, over REST) sees the same set of runs, untagged RUNNING runs included.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import FlowFilter, FlowRunFilter
from prefect.client.schemas.objects import FlowRun

from pinned_eval.inflight import is_point_of, is_step_point, point_runs_filter, steps_runs_filter


def point_flow_runs(client: SyncPrefectClient, run: str, *, page: int = 200) -> list[FlowRun]:
    """Every eval-point flow run of `run` (see `pinned_eval.inflight`), in the server's order."""
    body = point_runs_filter(run)
    flows = FlowFilter.model_validate(body["flows"])
    runs = FlowRunFilter.model_validate(body["flow_runs"])
    found: dict[str, FlowRun] = {}
    offset = 0
    while True:
        batch = client.read_flow_runs(flow_filter=flows, flow_run_filter=runs, limit=page, offset=offset)
        for fr in batch:
            if is_point_of(fr.parameters, run):
                found[str(fr.id)] = fr
        if len(batch) < page:
            return list(found.values())
        offset += page


SLACK = 10


def recent_point_flow_runs(
    client: SyncPrefectClient, run: str, *, last: int | None = None, since: int | None = None
) -> list[FlowRun]:
    """The eval-point flow runs of `run`'s latest `last` steps at or after step `since` (either
    None: no such bound), read newest first in pages of `last + 2 * SLACK` runs (at most 200) until a
    page holds `SLACK` runs below the window and ends with one.

    Points are created as training advances, so a step's first flow run is newer than the first
    runs of the steps before it: runs below the window's lowest step mean no older run belongs to
    it (points created a little out of order, a few in flight at once, are tolerated). A later
    rerun of an old step as a new flow run is read and left out when its step is outside the
    window; `SLACK` such reruns in one page, the last of them ending it, would end the read early.
    Cost: the window's pages (one when `last` is given), not the history's.
    """
    from prefect.client.schemas.sorting import FlowRunSort

    body = point_runs_filter(run)
    flows = FlowFilter.model_validate(body["flows"])
    runs = FlowRunFilter.model_validate(body["flow_runs"])
    page = 200 if last is None else min(200, last + 2 * SLACK)
    found: dict[str, FlowRun] = {}
    steps: set[int] = set()
    offset = 0
    while True:
        batch = client.read_flow_runs(
            flow_filter=flows, flow_run_filter=runs, sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=page, offset=offset,
        )  # fmt: skip
        below, last_below = 0, False  # runs of the page below the window; whether its oldest is
        for fr in batch:
            if not is_point_of(fr.parameters, run):
                continue
            step = int(fr.parameters["step"])
            if (since is not None and step < since) or (
                last is not None and len(steps) >= last and step < sorted(steps)[-last]
            ):
                below, last_below = below + 1, True
                continue
            last_below = False
            found[str(fr.id)] = fr
            steps.add(step)
        if len(batch) < page or (below >= SLACK and last_below):
            keep = set(sorted(steps)[-last:]) if last is not None else steps
            return [fr for fr in found.values() if int(fr.parameters["step"]) in keep]
        offset += page


def step_point_flow_runs(
    client: SyncPrefectClient, run: str, steps: Iterable[int], *, page: int = 200
) -> list[FlowRun]:
    """The eval-point flow runs of `run` at `steps`: those `point_flow_runs` holds for them, in the
    server's order (`pinned_eval.inflight.steps_runs_filter`, `page` step names per request).
    Cost: one request per `page` steps (plus a page per `page` runs in flight on the server),
    never the run's history."""
    wanted = sorted(set(steps))
    found: dict[str, FlowRun] = {}
    for i in range(0, len(wanted), page):
        chunk = wanted[i : i + page]
        body = steps_runs_filter(run, chunk)
        flows = FlowFilter.model_validate(body["flows"])
        runs = FlowRunFilter.model_validate(body["flow_runs"])
        offset = 0
        while True:
            batch = client.read_flow_runs(flow_filter=flows, flow_run_filter=runs, limit=page, offset=offset)
            for fr in batch:
                state = fr.state.type.value if fr.state else None
                if is_step_point(fr.parameters, fr.tags, state, run, set(chunk)):
                    found[str(fr.id)] = fr
            if len(batch) < page:
                break
            offset += page
    return list(found.values())
