"""Record tests/data/sglang_tool_calls_golden.jsonl with SGLang's own tool-call parsers.

Run with an interpreter that can import `sglang.srt.function_call` (real SGLang, or the
`sglang==0.5.23` wheel unpacked with its pure-Python dependencies), from the repository root:

    python scripts/record_sglang_tool_calls.py > tests/data/sglang_tool_calls_golden.jsonl

Each row: the parser, the completion text, the declared tools, and what SGLang's
`FunctionCallParser(tools, parser)` gives: `has_tool_call`, then `parse_non_stream`'s normal text
and calls (name, parameters, tool_index), or the exception type when it raises (SGLang's chat
serving then keeps the text unchanged). `tests/fast/test_engine_tool_calls.py` replays them
against `engine.tool_calls`.
"""

from __future__ import annotations

import json
import sys

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CODE = {"type": "function", "function": {"name": "code_interpreter", "description": "Run Python",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
TOOLS = [WEATHER, CODE]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL2 = '{"name": "code_interpreter", "arguments": {"code": "print(1+1)"}}'
TEXTS = [
    "The answer is 4.",
    f"<tool_call>\n{CALL}\n</tool_call>",
    f"Let me check the weather.\n<tool_call>\n{CALL}\n</tool_call>",
    f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL2}\n</tool_call>",
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
    f"<tool_call>\n{{not json}}\n</tool_call>\n<tool_call>\n{CALL2}\n</tool_call>",
    f"<tool_call>{CALL}</tool_call>",
    '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
    f"<tool_call>\n{CALL}",
    "<tool_call>\n42\n</tool_call>",
    f"<tool_call>\n[{CALL}, {CALL2}]\n</tool_call>",
    '<tool_call>\n{"name": "get_weather"}\n</tool_call>',
    f"  leading space text  \n<tool_call>\n{CALL}\n</tool_call> trailing",
    f"<tool_call>{CALL}</tool_call>\n<tool_call>{{broken</tool_call>",
    '<tool_call>\n{"name": "code_interpreter", "arguments": "print(1)"}\n</tool_call>',
]


def main() -> None:
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    for parser in ("qwen25", "hermes"):
        for tools in (TOOLS, []):
            for text in TEXTS if tools else TEXTS[:3]:
                fcp = FunctionCallParser([Tool.model_validate(t) for t in tools], parser)
                row = {"parser": parser, "text": text, "tools": tools, "has_tool_call": fcp.has_tool_call(text)}
                try:
                    normal, calls = fcp.parse_non_stream(text)
                    row |= {"normal_text": normal, "error": None,
                            "calls": [{"name": c.name, "parameters": c.parameters, "tool_index": c.tool_index}
                                      for c in calls]}
                except Exception as err:  # recorded: SGLang's serving keeps the text then
                    row |= {"normal_text": None, "calls": None, "error": type(err).__name__}
                sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
