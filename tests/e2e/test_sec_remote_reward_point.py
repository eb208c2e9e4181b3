"""A remote reward's token from the suite block's secret field, on a real point: sent as a bearer
header to a scoring service that requires it; obfuscated where the UI reads the block; and a wrong
one (echoed back by the service) appears in no skip message, JSONL row or flow-run log."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from blocks import FleetBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.sinks import JsonlSink
from pinned_eval.suite import DatasetSpec, EvalSuite, RemoteRewardConfig, SamplingDefaults
from tests.bearer_judge import BearerJudge
from tests.pointkit import CpuFleet, save_point_blocks, write_step_snapshot

pytestmark = pytest.mark.e2e

TOKEN = "rm-point-tok-8d3f0b6a1c2e"


@pytest.fixture
def judge() -> Iterator[BearerJudge]:
    server = BearerJudge(TOKEN)
    try:
        yield server
    finally:
        server.close()


def _logs(flow_run_id: object) -> list[str]:
    with get_client(sync_client=True) as c:
        logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))  # type: ignore[list-item]
    return [log.message for log in logs]


@pytest.mark.parametrize("token", [TOKEN, "rm-wrong-2f7a9c4e6b1d"], ids=["right", "wrong"])
def test_block_secret_token_is_a_bearer_header_and_never_printed(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path, judge: BearerJudge, token: str
) -> None:
    suite = EvalSuite(
        datasets=(DatasetSpec(name="judged", path="builtin:arith_add.jsonl", max_prompts=3, reward="remote_rm"),),
        defaults=SamplingDefaults(temperature=0.0, max_new_tokens=3),
        remote_reward=RemoteRewardConfig(url=judge.url, token=token, max_attempts=1, backoff_s=0),  # type: ignore[arg-type]
    )
    fleet = FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, suite=suite, keep_snapshots=0)
    with get_client(sync_client=True) as c:  # as the UI reads it: the token is a secret field
        doc = c.read_block_document_by_name(env.blocks["suite"], "pinned-eval-suite", include_secrets=False)
    assert token not in json.dumps(doc.data, default=str)
    assert doc.data["suite"]["remote_reward"]["token"] != token

    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, 4)
    write_step_snapshot(tiny_model, dest)
    state = eval_point(**env.params(4, source={"kind": "staged", "path": dest}), return_state=True)  # type: ignore[arg-type]
    assert judge.seen == [f"Bearer {token}"] * 3, "the saved block's token reached the service as a header"
    if token == TOKEN:
        assert state.is_completed() and state.name == "Completed", state.message
        [row] = JsonlSink(env.jsonl).read(env.run)
        assert row.state == "measured" and row.metrics["eval/judged-none_reward_ratio"] == 0
        return
    assert state.is_completed() and state.name == "Skipped", state.message
    assert state.message.startswith("reward_unavailable: dataset 'judged': remote reward"), state.message
    assert "HTTP 401: bad credentials: 'Bearer ***'" in state.message, state.message
    for where, text in [
        ("state message", state.message),
        ("JSONL", env.jsonl.read_text()),
        ("flow-run logs", "\n".join(_logs(state.state_details.flow_run_id))),
    ]:
        assert token not in text, where
