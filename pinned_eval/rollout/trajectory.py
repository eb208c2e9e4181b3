"""miles' session-server response of an agent-function sample, rebuilt from the gateway's transcript.

miles' `agentic_tool_call` wrapper collects the sample from its session server, which merges the
session's chat-completion turns into one token trajectory (`merge_samples`): the response is each
turn's output text, the EOS text included (`tokenizer.decode` of the output ids), and between two
turns the template delta of the messages the agent appended (the tool turn) plus the next
generation prompt. The delta is miles' default TITO rendering: the chat template of
`[{"role": "system", "content": "dummy system"}, <the previous assistant turn, empty content, its
tool calls>, *appended]` with the generation prompt, minus the same prefix rendered alone.

Contract of `session_response(calls, tokenizer, chat_template_kwargs)`:
- `calls`: the sample's transcript (`pinned_eval.gateway.records.transcript_entry`); every call must
  be an answered (200) `/v1/chat/completions` call with its `messages`.
- a turn's output text is rebuilt from the reply: its `content`, then its tool calls as the
  `qwen25` / `hermes` models write them (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`,
  one per call, joined by a newline, after the content and a newline when there is content),
  then the tokenizer's `eos_token` when the turn finished `stop` or `tool_calls`. This is exact
  for replies that end in the model's EOS; a turn stopped by a `stop` string, content the parser
  stripped of whitespace, or tool-call JSON spelled otherwise than `json.dumps` spells it are not
  recovered exactly (the transcript keeps the parsed reply, not the output tokens).
- turns merge as miles merges them: a turn that did not complete (`length`) ends the trajectory;
  call k's messages must start with call k-1's messages followed by an assistant message (miles'
  append-only session); the response's status and weight versions are those of the merged turns.
- anything else (another route, a rewritten history, a template whose render is not
  prefix-stable, a tokenizer error) raises `TrajectoryError`, and the caller falls back to the last
  reply (logged). Returns `(response, response_length, merged_calls)`, the length counted as miles
  counts it: each turn's `completion_tokens` plus each delta's tokens.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

__all__ = ["DUMMY_SYSTEM", "TrajectoryError", "output_text", "session_response"]

DUMMY_SYSTEM: dict[str, Any] = {"role": "system", "content": "dummy system"}
_CHAT = "/v1/chat/completions"


class TrajectoryError(ValueError):
    """The transcript cannot be merged as miles' session server merges it."""


def _call_text(call: Any) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise TrajectoryError(f"a tool call without a function name: {str(call)[:200]}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise TrajectoryError(f"tool call {function['name']!r}: arguments are not JSON ({exc})") from None
    body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def output_text(entry: dict[str, Any], eos: str | None) -> str:
    """One turn's output text as `tokenizer.decode` of its output ids gives it (see the module docstring)."""
    content = entry.get("text") or ""
    calls = "\n".join(_call_text(c) for c in entry.get("tool_calls") or [])
    text = f"{content}\n{calls}" if content and calls else content + calls
    if entry.get("finish_reason") in ("stop", "tool_calls") and eos:
        text += eos
    return text


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, generation: bool,
            kwargs: dict[str, Any]) -> str:
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **extra, **kwargs)
    if not isinstance(text, str):
        raise TrajectoryError(f"the chat template rendered {type(text).__name__}, not text")
    return text


def _delta(tokenizer: Any, assistant: dict[str, Any], appended: list[dict[str, Any]], tools: Any,
           kwargs: dict[str, Any]) -> str:
    dummy = {"role": "assistant", "content": "", "reasoning_content": " ",
             "tool_calls": assistant.get("tool_calls") or []}
    without = _render(tokenizer, [DUMMY_SYSTEM, dummy], tools, False, kwargs)
    with_ = _render(tokenizer, [DUMMY_SYSTEM, dummy, *appended], tools, True, kwargs)
    if not with_.startswith(without):
        raise TrajectoryError(f"the chat template is not prefix-stable for {[m.get('role') for m in appended]}")
    return with_[len(without):]


def session_response(
    calls: list[dict[str, Any]], tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None
) -> tuple[str, int, list[dict[str, Any]]]:
    """The merged response (see the module docstring)."""
    if not calls:
        raise TrajectoryError("no call in the sample's session")
    for i, c in enumerate(calls):
        chat = str(c.get("route", "")).endswith(_CHAT) and isinstance(c.get("messages"), list)
        if not chat or c.get("status") != 200:
            raise TrajectoryError(f"call {i} is not an answered chat completion ({c.get('route')}, {c.get('status')})")
    kwargs = dict(chat_template_kwargs or {})
    eos = getattr(tokenizer, "eos_token", None)
    parts = [output_text(calls[0], eos)]
    length = int(calls[0].get("completion_tokens") or 0)
    merged = [calls[0]]
    for prev, cur in itertools.pairwise(calls):
        if prev.get("finish_reason") not in ("stop", "tool_calls"):
            break  # miles: only a completed turn is extended
        before, now = prev["messages"], cur["messages"]
        n = len(before)
        if now[:n] != before or len(now) <= n or not isinstance(now[n], dict) or now[n].get("role") != "assistant":
            raise TrajectoryError(f"call {len(merged)}'s messages do not extend call {len(merged) - 1}'s "
                                  "with its assistant reply (miles' session is append-only)")
        try:
            delta = _delta(tokenizer, now[n], now[n + 1:], cur.get("tools"), kwargs)
            length += len(tokenizer.encode(delta, add_special_tokens=False))
        except TrajectoryError:
            raise
        except Exception as exc:  # a template or tokenizer error: the caller falls back
            raise TrajectoryError(f"chat template: {type(exc).__name__}: {exc}") from exc
        parts += [delta, output_text(cur, eos)]
        length += int(cur.get("completion_tokens") or 0)
        merged.append(cur)
    return "".join(parts), length, merged
