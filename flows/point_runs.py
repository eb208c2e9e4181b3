"""A run's eval-point flow runs read with Prefect's client: the query of `pinned_eval.inflight`.

Used by the janitor flow and by the app's history and operator commands, so every reader (and
the trainer side, over REST) sees the same set of runs, untagged RUNNING runs included.
"""

from __future__ import annotations

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import FlowFilter, FlowRunFilter
from prefect.client.schemas.objects import FlowRun

from pinned_eval.inflight import is_point_of, point_runs_filter


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
