"""`miles.rollout.generate_utils.tool_call_utils` as pinned-eval serves it (no SGLang import).

- `create_tool_call_parser(tool_specs, parser)`: `qwen25` or `hermes` (both emit
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`); `parse_non_stream(text)` returns
  `(normal_text, [ToolCallItem(name, parameters=<arguments JSON>)])`, calls of tools not in
  `tool_specs` (or not JSON) dropped, as SGLang's parser does;
- `execute_tool_calls(calls, execute_one)`: each call in order, `await execute_one(name, params)`
  (a string), as `{"role": "tool", "tool_call_id", "content", "name"}` messages;
- `update_sample_with_tool_responses(sample, messages, tokenizer)`: the tool messages' tokens as
  the chat template appends them after an assistant turn (rendered with and without them),
  appended to the sample's tokens and response text with loss mask 0 and logprob 0.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pinned_eval.agentic.compat.types import Sample

__all__ = ["ToolCallItem", "create_tool_call_parser", "execute_tool_calls", "update_sample_with_tool_responses"]

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_DUMMY_USER = {"role": "user", "content": "dummy"}


@dataclass
class ToolCallItem:
    name: str
    parameters: str
    tool_index: int = 0


class _Parser:
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def parse_non_stream(self, text: str) -> tuple[str, list[ToolCallItem]]:
        calls: list[ToolCallItem] = []
        for raw in _CALL.findall(text):
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("name") in self.names:
                calls.append(ToolCallItem(obj["name"], json.dumps(obj.get("arguments", obj.get("parameters", {}))),
                                          len(calls)))
        start = text.find("<tool_call>")
        return (text if start < 0 else text[:start]).strip(), calls


def create_tool_call_parser(tool_specs: list[dict[str, Any]], tool_call_parser: str | None) -> _Parser:
    if tool_call_parser not in ("qwen25", "hermes"):
        raise ValueError(f"tool call parser {tool_call_parser!r}: pinned-eval parses 'qwen25' and 'hermes'")
    return _Parser({spec["function"]["name"] for spec in tool_specs})


async def execute_tool_calls(
    tool_calls: list[ToolCallItem], execute_one: Callable[[str, dict[str, Any]], Awaitable[str]]
) -> list[dict[str, Any]]:
    out = []
    for call in tool_calls:
        result = await execute_one(call.name, json.loads(call.parameters) if call.parameters else {})
        if not isinstance(result, str):
            raise TypeError(f"tool {call.name!r} returned {type(result).__name__}, not str")
        out.append({"role": "tool", "tool_call_id": f"call_{uuid.uuid4().hex[:24]}", "content": result,
                    "name": call.name})
    return out


def _tool_tokens(messages: list[dict[str, Any]], tokenizer: Any) -> list[int]:
    assistant = {"role": "assistant", "content": "", "reasoning_content": " ", "tool_calls": [
        {"id": m.get("tool_call_id", f"call0000{i}"), "type": "function",
         "function": {"name": m.get("name", "dummy_func"), "arguments": {}}} for i, m in enumerate(messages)]}
    base = [_DUMMY_USER, assistant]
    with_ = tokenizer.apply_chat_template(base + messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    without = tokenizer.apply_chat_template(base, tokenize=True, add_generation_prompt=False, return_dict=False)
    if list(with_[: len(without)]) != list(without):
        raise ValueError("tool responses: the chat template does not append them (token prefix mismatch)")
    return list(with_[len(without):])


def update_sample_with_tool_responses(sample: Sample, tool_messages: list[dict[str, Any]], tokenizer: Any) -> None:
    ids = _tool_tokens(tool_messages, tokenizer)
    sample.response += tokenizer.decode(ids)
    sample.response_length += len(ids)
    sample.tokens = sample.tokens + ids
    sample.loss_mask = (sample.loss_mask or []) + [0] * len(ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [0.0] * len(ids)
