"""Agentic transcripts kept: through the results store, the W&B samples table, `compare` and a rescore."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pinned_eval.results.compare import compare_samples, format_flips
from pinned_eval.results.store import GENERATIONS, SAMPLES, ResultsStore
from pinned_eval.results.tables import (
    SAMPLE_FIELDS,
    generation_fields,
    generations_table,
    samples_table,
    table_key,
)
from pinned_eval.results.transcripts import TranscriptDiff, transcript_diff
from pinned_eval.sinks import log_to_wandb
from pinned_eval.sinks.wandb import WandbConfig, WandbExporter
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults
from tasks.generate import Generation
from tasks.results import sample_rows
from tasks.score import score_generations
from tests.wandb_offline import logged_tables

CALL = {"id": "c1", "type": "function", "function": {"name": "python", "arguments": '{"code": "print(3+4)"}'}}


def _transcript(tool_output: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "3+4?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": tool_output, "tool_call_id": "c1"},
        {"role": "assistant", "content": f"The answer is {tool_output}"},
    ]


def _agentic(i: int, tool_output: str, reward: float | None = None) -> Generation:
    return Generation(
        dataset="tool", prompt_index=i, sample_index=0, prompt="3+4?", label="7", metadata={},
        response=f"The answer is {tool_output}", response_len=4, finish_reason="stop", weight_version="5",
        prompt_tokens=3, messages=_transcript(tool_output), turns=2, tool_calls=[CALL], status="completed",
        reward=reward,
    )


def _single(i: int, response: str) -> Generation:
    return Generation(dataset="add", prompt_index=i, sample_index=0, prompt=f"{i}+1=", label=str(i + 1), metadata={},
                      response=response, response_len=1, finish_reason="stop", weight_version="5", prompt_tokens=2)


def _rows(gens: list[Generation], reward: float) -> list[dict[str, Any]]:
    return sample_rows(gens, {(g.dataset, g.prompt_index, g.sample_index): reward for g in gens})


def test_transcripts_round_trip_through_the_store(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path / "results"))
    gens = [_agentic(0, "7", reward=0.5), _agentic(1, "7")]
    store.write("exp", 5, SAMPLES, samples_table(_rows(gens, 1.0), key="k1"))
    table = store.read("exp", 5, SAMPLES)
    assert table.column_names == [f.name for f in SAMPLE_FIELDS] + [
        "messages", "turns", "tool_calls", "status", "rollout_reward"]
    assert table_key(table) == "k1"
    rows = table.to_pylist()
    assert [Generation(**generation_fields(r)) for r in rows] == gens
    assert json.loads(rows[0]["messages"])[1]["tool_calls"] == [CALL]
    assert [(r["turns"], r["status"], r["reward"], r["rollout_reward"]) for r in rows] == [
        (2, "completed", 1.0, 0.5), (2, "completed", 1.0, None)]


def test_single_turn_tables_keep_their_columns_exactly(tmp_path: Path) -> None:
    table = samples_table(_rows([_single(0, "1")], 1.0), key=None)
    assert table.column_names == [f.name for f in SAMPLE_FIELDS]
    assert [Generation(**generation_fields(r)) for r in table.to_pylist()] == [_single(0, "1")]


def test_wandb_samples_table_adds_transcript_columns_only_for_agentic_datasets(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path / "results"))
    gens = [_agentic(0, "7", reward=0.5), _single(0, "1")]
    store.write("exp", 5, SAMPLES, samples_table(_rows(gens, 1.0), key="k1"))
    exporter = WandbExporter(WandbConfig(project="p", directory=str(tmp_path / "wandb"), samples_per_dataset=2), store)
    tables = exporter.sample_tables("exp", 5)
    log_to_wandb({"eval/step": 5.0}, project="p", run_id="exp", entity=None, mode="offline",
                 directory=str(tmp_path / "wandb"), tables=tables)
    logged = logged_tables(tmp_path / "wandb")
    base = ["example_id", "sample_index", "prompt", "response", "reward", "finish_reason", "completion_tokens",
            "weight_version"]
    assert logged["eval/samples/add"]["columns"] == base  # single-turn: unchanged
    assert logged["eval/samples/add"]["data"] == [[0, 0, "0+1=", "1", 1.0, "stop", 1, "5"]]
    tool = logged["eval/samples/tool"]
    assert tool["columns"] == [*base, "turns", "status", "tool_calls", "messages"]
    [row] = tool["data"]
    assert row[:8] == [0, 0, "3+4?", "The answer is 7", 1.0, "stop", 4, "5"]
    assert row[8:10] == [2, "completed"]
    assert json.loads(row[10]) == [CALL]
    assert json.loads(row[11]) == _transcript("7")


def _two_steps(tmp_path: Path) -> ResultsStore:
    store = ResultsStore(str(tmp_path / "results"))
    store.write("exp", 1, SAMPLES, samples_table(_rows([_agentic(0, "7"), _agentic(1, "7")], 1.0), key=None))
    store.write("exp", 2, SAMPLES, samples_table(_rows([_agentic(0, "7"), _agentic(1, "8")], 1.0), key=None))
    return store


def test_compare_shows_where_two_steps_transcripts_first_differ(tmp_path: Path) -> None:
    store = _two_steps(tmp_path)
    flips = compare_samples(store.read("exp", 1, SAMPLES), store.read("exp", 2, SAMPLES))
    assert format_flips("exp", 1, 2, flips) == "\n".join([
        "run exp: step 1 (A) vs step 2 (B)",
        "tool: 2 examples, 0 correct in A and wrong in B, 0 wrong in A and correct in B, "
        "1 with transcripts that differ",
        "  [transcripts differ] #1 first at turn 2",
        "      A tool: '7'",
        "      B tool: '8'",
    ])
    assert [f.as_json() for f in flips] == [{
        "dataset": "tool", "examples": 2, "lost": [], "gained": [], "unmatched": 0,
        "transcripts": [{"example_id": 1, "turn": 2, "role_a": "tool", "role_b": "tool", "excerpt_a": "7",
                         "excerpt_b": "8"}],
    }]


def test_old_files_without_transcript_columns_still_compare(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path / "results"))
    store.write("exp", 1, SAMPLES, samples_table(_rows([_single(0, "1"), _single(1, "2")], 1.0), key=None))
    store.write("exp", 2, SAMPLES, samples_table(_rows([_single(0, "1"), _single(1, "3")], 0.0), key=None))
    old = store.read("exp", 1, SAMPLES)
    assert "messages" not in old.column_names
    flips = compare_samples(old, store.read("exp", 2, SAMPLES))
    assert format_flips("exp", 1, 2, flips).splitlines()[1] == (
        "add: 2 examples, 2 correct in A and wrong in B, 0 wrong in A and correct in B")
    assert "transcripts" not in flips[0].as_json()
    # an old file against a new one with transcripts: compared as before, no transcript diff
    agentic = samples_table(_rows([_agentic(0, "8")], 1.0), key=None)
    [d] = compare_samples(samples_table(_rows([_agentic(0, "7")], 1.0), key=None).drop_columns(
        ["messages", "turns", "tool_calls", "status", "rollout_reward"]), agentic)
    assert d.transcripts == [] and d.examples == 1


def test_rescore_keeps_a_stored_rollout_reward(tmp_path: Path) -> None:
    suite = EvalSuite(
        datasets=(DatasetSpec(name="tool", path="builtin:arith_add.jsonl", max_prompts=3),),
        defaults=SamplingDefaults(temperature=0.0, max_new_tokens=5, reward="exact_match"),
    )
    store = ResultsStore(str(tmp_path / "results"))
    gens = [_agentic(0, "7", reward=0.25), _agentic(1, "7"), _agentic(2, "7").model_copy(update={"status": "aborted"})]
    store.write("exp", 5, GENERATIONS, generations_table(_rows(gens, 0.0), "k"))
    stored = [Generation(**generation_fields(r)) for r in store.read("exp", 5, GENERATIONS).to_pylist()]
    assert stored == gens  # what a cache hit and a rescore read back: the whole transcript
    _, _, rewards = score_generations(stored, suite.resolved(), suite, step=5)
    # kept; the next scored by exact_match; the aborted one, as at the point, unscored
    assert rewards == {("tool", 0, 0): 0.25, ("tool", 1, 0): 0.0, ("tool", 2, 0): None}


def _call(version: str, history: list[dict[str, Any]], text: str, call_id: str | None) -> dict[str, Any]:
    calls = [{**CALL, "id": call_id}] if call_id else []
    return {"route": "/sessions/{id}/v1/chat/completions", "status": 200, "messages": history, "text": text,
            "tool_calls": calls, "finish_reason": "tool_calls" if calls else "stop", "weight_version": version,
            "prompt_tokens": 9, "completion_tokens": 3}


def _gateway_transcript(version: str, second_output: str) -> list[dict[str, Any]]:
    """Three model calls as the point gateway records them; tool-call ids are random per step."""
    user = {"role": "user", "content": "3+4, twice?"}
    turn0 = {"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": f"a{version}"}]}
    turn1 = {"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": f"b{version}"}]}
    h1 = [user, turn0, {"role": "tool", "content": "7", "tool_call_id": f"a{version}"}]
    h2 = [*h1, turn1, {"role": "tool", "content": second_output, "tool_call_id": f"b{version}"}]
    return [_call(version, [user], "", f"a{version}"), _call(version, h1, "", f"b{version}"),
            _call(version, h2, f"Both are {second_output}", None)]


def test_gateway_transcripts_differ_only_in_what_was_said(tmp_path: Path) -> None:
    def step(version: str, out1: str) -> Any:
        gens = [_agentic(i, "7").model_copy(update={"messages": _gateway_transcript(version, o), "turns": 3})
                for i, o in enumerate(["7", out1])]
        return samples_table(_rows(gens, 1.0), key=None)

    [d] = compare_samples(step("1", "7"), step("2", "8"))  # versions and call ids differ everywhere
    assert [t.model_dump() for t in d.transcripts] == [
        {"example_id": 1, "turn": 2, "role_a": "tool", "role_b": "tool", "excerpt_a": "7", "excerpt_b": "8"}]
    [same] = compare_samples(step("1", "7"), step("2", "7"))
    assert same.transcripts == []
    shorter = _agentic(0, "7").model_copy(update={"messages": _gateway_transcript("2", "7")[:2]})
    [cut] = compare_samples(step("1", "7"), samples_table(_rows([shorter], 1.0), key=None))
    assert [t.model_dump() for t in cut.transcripts] == [
        {"example_id": 0, "turn": 2, "role_a": "user", "role_b": "(none)", "excerpt_a": "3+4, twice?",
         "excerpt_b": ""}]


def test_a_differing_tool_call_is_excerpted_as_name_and_arguments() -> None:
    other = {**CALL, "id": "zz", "function": {"name": "python", "arguments": '{"code": "print(3*4)"}'}}
    a = {"messages": json.dumps(_transcript("7"))}
    b = {"messages": json.dumps([_transcript("7")[0], {"role": "assistant", "content": "", "tool_calls": [other]}])}
    assert transcript_diff(4, a, b) == TranscriptDiff(
        example_id=4, turn=1, role_a="assistant", role_b="assistant",
        excerpt_a='python({"code": "print(3+4)"})', excerpt_b='python({"code": "print(3*4)"})')
    assert transcript_diff(4, a, {"messages": None}) is None and transcript_diff(4, a, {}) is None
