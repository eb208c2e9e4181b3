"""`pinned-eval compare` and `rescore` on stored agentic samples, through the CLI and the session's
Prefect server (the blocks); no fleet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import app
from blocks import EvalSuiteBlock, SinksBlock
from pinned_eval.results.store import GENERATIONS, SAMPLES, ResultsStore
from pinned_eval.results.tables import generation_fields, generations_table, is_rescored, samples_table
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults
from tests.fast.test_transcripts_kept import _agentic, _rows

pytestmark = pytest.mark.e2e


def _store(tmp_path: Path, name: str) -> ResultsStore:
    sinks = SinksBlock(jsonl_path=str(tmp_path / "m.jsonl"), results_root=str(tmp_path / "results"))
    sinks.save(name, overwrite=True)
    store = sinks.results_store()
    assert store is not None
    return store


def test_compare_prints_where_transcripts_first_differ(prefect_server: str, tmp_path: Path) -> None:
    store = _store(tmp_path, "transcripts-store")
    store.write("exp", 1, SAMPLES, samples_table(_rows([_agentic(0, "7"), _agentic(1, "7")], 1.0), key=None))
    store.write("exp", 2, SAMPLES, samples_table(_rows([_agentic(0, "7"), _agentic(1, "8")], 1.0), key=None))
    result = CliRunner().invoke(app, ["compare", "exp", "1", "2", "--sinks", "transcripts-store"])
    assert result.exit_code == 0, result.output
    assert result.output == (
        "run exp: step 1 (A) vs step 2 (B)\n"
        "tool: 2 examples, 0 correct in A and wrong in B, 0 wrong in A and correct in B, "
        "1 with transcripts that differ\n"
        "  [transcripts differ] #1 first at turn 2\n"
        "      A tool: '7'\n"
        "      B tool: '8'\n"
    )
    result = CliRunner().invoke(app, ["compare", "exp", "1", "2", "--sinks", "transcripts-store", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == [{
        "dataset": "tool", "examples": 2, "lost": [], "gained": [], "unmatched": 0,
        "transcripts": [{"example_id": 1, "turn": 2, "role_a": "tool", "role_b": "tool", "excerpt_a": "7",
                         "excerpt_b": "8"}],
    }]


def test_rescore_keeps_stored_rollout_rewards_and_transcripts(prefect_server: str, tmp_path: Path) -> None:
    store = _store(tmp_path, "transcripts-rescore")
    suite = EvalSuite(
        datasets=(DatasetSpec(name="tool", path="builtin:arith_add.jsonl", max_prompts=2),),
        defaults=SamplingDefaults(temperature=0.0, max_new_tokens=5, reward="exact_match"),
    )
    EvalSuiteBlock(suite=suite).save("transcripts-suite", overwrite=True)
    gens = [_agentic(0, "7", reward=0.25), _agentic(1, "7")]
    store.write("exp", 3, GENERATIONS, generations_table(_rows(gens, 0.0), "k"))
    result = CliRunner().invoke(app, ["rescore", "exp", "3", "--suite", "transcripts-suite",
                                      "--sinks", "transcripts-rescore"])
    assert result.exit_code == 0, result.output
    assert result.output == "tool: eval/tool=0.1250 (rescored)\n"  # (0.25 kept + 0.0 exact_match) / 2
    table = store.read("exp", 3, SAMPLES)
    assert is_rescored(table)
    rows = table.to_pylist()
    assert [r["reward"] for r in rows] == [0.25, 0.0]
    assert [r["rollout_reward"] for r in rows] == [0.25, None]
    assert [generation_fields(r)["messages"] for r in rows] == [g.messages for g in gens]
