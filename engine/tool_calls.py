"""Server-side tool-call parsing: SGLang's `qwen25` and `hermes` parsers (`--tool-call-parser`).

Behaviour of SGLang 0.5.23's non-streaming path (`Qwen25Detector` / `HermesDetector`
`.detect_and_parse`, `BaseFormatDetector.parse_base_json`, `FunctionCallParser.parse_non_stream`
and `OpenAIServingChat._process_tool_calls`), re-implemented without importing SGLang and
checked against outputs of SGLang's own code (tests/data/sglang_tool_calls_golden.jsonl):
- A request parses tool calls only when the server has a parser, the request declares `tools`
  and `tool_choice` is not "none" (also under "required" or a named tool: for these two formats
  SGLang parses the model's native output; the CPU engine does not constrain decoding).
- `qwen25` looks for `<tool_call>\\n...\\n</tool_call>` blocks (the newlines are part of the
  markers); `hermes` for `<tool_call>...</tool_call>`, or an unterminated `<tool_call>...` at the
  end. `content` becomes the text before the first marker, stripped.
- Each block is JSON: an object, or (hermes) a list of objects, each with `name` and `arguments`
  (or `parameters`). A call naming a tool the request did not declare is dropped. `arguments`
  are re-serialised with `json.dumps(..., ensure_ascii=False)`. qwen25 skips a block that is not
  JSON; hermes gives up on the whole text (content = the whole text, no calls).
- Calls found: `message.tool_calls = [{id: "call_<24 hex>", index: <ordinal>, type: "function",
  function: {name, arguments}}]`, and a `stop` finish becomes `tool_calls` (matched_stop null);
  a `length` finish stays. A marker but no valid call: no `tool_calls`, content as above.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

ToolCallParserName = Literal["qwen25", "hermes"]
PARSERS: tuple[str, ...] = ("qwen25", "hermes")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    tool_index: int  # the tool's position in the request's `tools`


@dataclass(frozen=True)
class ParseResult:
    """`content` is the message text; `calls` is None when the output holds no tool call marker."""

    content: str
    calls: list[ParsedCall] | None


def _tool_names(tools: list[dict[str, Any]]) -> dict[str, int]:
    names: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name:
            names[name] = i
    return names


def _calls_from_json(action: Any, names: dict[str, int]) -> list[ParsedCall]:
    """SGLang's `parse_base_json`: unknown tools are dropped (its default)."""
    out = []
    for act in action if isinstance(action, list) else [action]:
        name = act.get("name")  # a non-object raises, as in SGLang (the caller keeps the text)
        if not (name and name in names):
            continue
        args = act.get("parameters") or act.get("arguments", {})
        out.append(ParsedCall(name=name, arguments=json.dumps(args, ensure_ascii=False), tool_index=names[name]))
    return out


def _qwen25(text: str, names: dict[str, int]) -> ParseResult:
    bot, eot = "<tool_call>\n", "\n</tool_call>"
    idx = text.find(bot)
    if idx == -1:
        return ParseResult(text, None)
    calls: list[ParsedCall] = []
    for block in re.findall(rf"{re.escape(bot)}(.*?){re.escape(eot)}", text, re.DOTALL):
        try:
            parsed = json.loads(block.strip())
        except json.JSONDecodeError:
            continue
        calls.extend(_calls_from_json(parsed, names))
    return ParseResult(text[:idx].strip(), calls)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _hermes(text: str, names: dict[str, int]) -> ParseResult:
    idx = text.find("<tool_call>")
    if idx == -1:
        return ParseResult(text, None)
    calls: list[ParsedCall] = []
    try:
        for match in _HERMES.findall(text):
            raw = match[0] or match[1]
            if raw:
                calls.extend(_calls_from_json(json.loads(raw.strip()), names))
    except Exception:  # SGLang: any failure keeps the whole text and no calls
        return ParseResult(text, [])
    return ParseResult(text[:idx].strip(), calls)


def parse(parser: str, text: str, tools: list[dict[str, Any]]) -> ParseResult:
    """Split one completion into content and tool calls, as SGLang's parser named `parser` does."""
    if not tools:
        return ParseResult(text, None)
    names = _tool_names(tools)
    try:
        return _qwen25(text, names) if parser == "qwen25" else _hermes(text, names)
    except Exception:  # SGLang's serving layer: a parser error leaves the text as it was
        return ParseResult(text, [])


def apply(
    parser: str | None, text: str, tools: list[dict[str, Any]], tool_choice: Any, finish: dict
) -> tuple[str, list[dict] | None, dict]:
    """(content, tool_calls or None, finish_reason) of one chat choice (see the module contract)."""
    if parser is None or not tools or tool_choice == "none":
        return text, None, finish
    result = parse(parser, text, tools)
    if not result.calls:
        return result.content, None, finish
    calls = [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "index": k, "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for k, c in enumerate(result.calls)
    ]
    if finish.get("type") == "stop":
        finish = {**finish, "type": "tool_calls", "matched": None}
    return result.content, calls, finish
