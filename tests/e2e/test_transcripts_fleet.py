"""A real agentic transcript (an agent function over chat completions, through the point gateway,
a CPU engine behind the real sglang-router: tests/e2e/test_function_fleet.py's fleet) kept in the
samples Parquet and the W&B samples table, and compared between two runs of the point."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.fleet.launcher import LaunchedFleet
from pinned_eval.results.compare import compare_samples
from pinned_eval.results.store import SAMPLES, ResultsStore
from pinned_eval.results.tables import generation_fields, samples_table
from pinned_eval.sinks import log_to_wandb
from pinned_eval.sinks.wandb import WandbConfig, WandbExporter
from tasks.generate import Generation
from tasks.results import sample_rows
from tests.e2e.test_function_fleet import TOOLS, _ds, _point, fleet, http, model  # noqa: F401 (fixtures)
from tests.wandb_offline import logged_tables

pytestmark = pytest.mark.e2e


async def test_a_gateway_transcript_is_stored_logged_and_compared(
    fleet: LaunchedFleet, http: httpx.AsyncClient, model: Path, tmp_path: Path  # noqa: F811
) -> None:
    ds = _ds("agent", "miles.rollout.generate_hub.agentic_tool_call.generate",
             "custom:agent_chat.reward_from_metadata", max_new_tokens=256,
             custom_agent_function_path="agent_chat.run_agent")
    rows = [EvalSample(0, "What is 2+2?", "4", {"tools": TOOLS})]
    first = await _point(fleet, http, model, ds, rows)
    second = await _point(fleet, http, model, ds, rows)
    store = ResultsStore(str(tmp_path / "results"))
    for step, samples in ((1, first), (2, second)):
        rewards = {(s.dataset, s.prompt_index, s.sample_index): s.reward for s in samples}
        store.write("exp", step, SAMPLES, samples_table(sample_rows(samples, rewards), key=None))
    table = store.read("exp", 1, SAMPLES)
    [row] = table.to_pylist()
    back = [Generation(**generation_fields(r)) for r in table.to_pylist()]
    assert back == [s.model_copy(update={"usage": None}) for s in first]  # all but usage (not stored)
    assert (row["turns"], row["status"], row["rollout_reward"], row["reward"]) == (2, "completed", 1.0, 1.0)
    assert [c["finish_reason"] for c in json.loads(row["messages"])] == ["tool_calls", "stop"]
    # the same point run twice said the same thing (tool-call ids differ per call): no transcript diff
    [d] = compare_samples(table, store.read("exp", 2, SAMPLES))
    assert (d.examples, d.lost, d.gained, d.transcripts) == (1, [], [], [])

    wandb_dir = tmp_path / "wandb"
    exporter = WandbExporter(WandbConfig(project="p", directory=str(wandb_dir), samples_per_dataset=1), store)
    log_to_wandb({"eval/step": 1.0}, project="p", run_id="exp", entity=None, mode="offline",
                 directory=str(wandb_dir), tables=exporter.sample_tables("exp", 1))
    logged = logged_tables(wandb_dir)["eval/samples/agent"]
    assert logged["columns"][-4:] == ["turns", "status", "tool_calls", "messages"]
    [data] = logged["data"]
    assert data[-4:-1] == [2, "completed", None]  # the agent function returned no tool calls of its own
    assert json.loads(data[-1]) == first[0].messages
