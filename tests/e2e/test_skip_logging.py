"""An expected skip is a WARNING naming its reason, not an ERROR with tracebacks (issue 20 item 7).

A ckpt_missing point (its staged snapshot lacks `.complete`: the `check` task raises the skip) on
the session's server; the fleet is never reached, so it is a dead attach fleet."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import Log

from blocks import FleetBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.polling import poll_until
from tests.conftest import free_port
from tests.pointkit import save_point_blocks

pytestmark = pytest.mark.e2e


def _logs(flow_run_id: object) -> list[Log]:
    """The run's logs once the flow's own skip warning has reached the API (logs go in batches)."""

    def read() -> list[Log] | None:
        with get_client(sync_client=True) as c:
            logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return logs if any(log.message.startswith("skipped ") for log in logs) else None

    return poll_until(read, timeout_s=30, interval_s=0.5, what="the flow run's skip warning in its logs")


def test_an_expected_skip_is_one_warning_without_traceback(prefect_server: str, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    env = save_point_blocks(tmp_path, FleetBlock(name=f"d{uuid.uuid4().hex[:6]}", mode="attach",
                                                 engine_urls=[dead], router_url=dead))
    dest = Path(StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, 3))
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")  # no `.complete`: ckpt_missing (missing_marker)

    state = eval_point(**env.params(3, source={"kind": "staged", "path": str(dest)}), return_state=True)
    assert state.name == "Skipped" and state.message.startswith("ckpt_missing"), state.message

    logs = _logs(state.state_details.flow_run_id)
    assert [log.message for log in logs if log.level >= 40] == [], "no ERROR for an expected skip"
    assert [log.message for log in logs if "Traceback" in log.message] == []
    warnings = [log.message for log in logs if log.level == 30]
    assert len(warnings) == 1 and warnings[0].startswith(f"skipped {env.run}/step-3: ckpt_missing: "), warnings
