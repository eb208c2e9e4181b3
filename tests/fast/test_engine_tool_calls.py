"""`engine.tool_calls` against SGLang's own `qwen25` / `hermes` parsers, string for string.

tests/data/sglang_tool_calls_golden.jsonl holds what SGLang 0.5.23's `FunctionCallParser`
returned on each text (recorded by scripts/record_sglang_tool_calls.py from the unpacked wheel).
Where SGLang's parser raised, its chat serving keeps the text as the content and reports no calls.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from engine import tool_calls

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "sglang_tool_calls_golden.jsonl"
ROWS: list[dict[str, Any]] = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines()]
TOOLS = ROWS[0]["tools"]


def test_the_golden_file_covers_both_parsers_and_the_edge_cases() -> None:
    assert len(ROWS) == 38
    assert {r["parser"] for r in ROWS} == {"qwen25", "hermes"}
    assert sum(r["error"] is not None for r in ROWS) == 1  # qwen25 on a non-object JSON block
    assert sum(bool(r["calls"]) for r in ROWS) == 21


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['parser']}-{i}" for i, r in enumerate(ROWS)])
def test_parse_agrees_with_sglang(row: dict[str, Any]) -> None:
    result = tool_calls.parse(row["parser"], row["text"], row["tools"])
    calls = [{"name": c.name, "parameters": c.arguments, "tool_index": c.tool_index} for c in result.calls or []]
    if row["error"] is not None:  # SGLang raised: the serving layer keeps the text, no calls
        assert (result.content, calls) == (row["text"], [])
    else:
        assert (result.content, calls) == (row["normal_text"], row["calls"])
    assert (result.calls is not None) == (row["has_tool_call"] or row["error"] is not None)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_apply_gives_openai_tool_calls_with_ids_and_finish_tool_calls() -> None:
    stop = {"type": "stop", "matched": 2}
    content, calls, finish = tool_calls.apply("qwen25", f"Checking.\n{CALL}", TOOLS, "auto", stop)
    assert content == "Checking." and finish == {"type": "tool_calls", "matched": None}
    assert calls is not None and len(calls) == 1
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0]["id"])
    assert {k: v for k, v in calls[0].items() if k != "id"} == {
        "index": 0, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    _, again, _ = tool_calls.apply("qwen25", CALL, TOOLS, "auto", {"type": "stop", "matched": 2})
    assert again is not None and again[0]["id"] != calls[0]["id"]  # fresh ids per reply


def test_apply_keeps_a_length_finish_and_needs_parser_tools_and_choice() -> None:
    length = {"type": "length", "length": 40}
    assert tool_calls.apply("hermes", CALL, TOOLS, "auto", length)[2] == length
    for parser, tools, choice in ((None, TOOLS, "auto"), ("qwen25", [], "auto"), ("qwen25", TOOLS, "none")):
        assert tool_calls.apply(parser, CALL, tools, choice, {"type": "stop", "matched": 2}) == (
            CALL, None, {"type": "stop", "matched": 2},
        )


def test_a_marker_without_a_valid_call_leaves_no_tool_calls() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'
    assert tool_calls.apply("qwen25", text, TOOLS, "auto", {"type": "stop", "matched": 2}) == (
        "Sure.", None, {"type": "stop", "matched": 2},
    )
