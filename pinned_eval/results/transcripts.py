"""Where two steps' transcripts of one example first differ (`pinned-eval compare`).

A stored transcript (`messages` column, JSON) is either the point gateway's: one entry per model
call (`pinned_eval.gateway.records.transcript_entry`: the request's `messages` / `prompt` / `text`
/ `input_ids`, the reply's `text` and `tool_calls`), or a list of chat messages (`role`,
`content`, `tool_calls`). Each entry is read as a sequence of units (role, text, tool calls): a
gateway entry's request messages (or its prompt, role `prompt`), then its reply (role
`assistant`); a chat message is one unit. Only these are compared: weight versions, token counts,
statuses and tool-call ids (random per call) are not, so two steps that said the same thing do not
differ. `turn` is the index of the first differing entry (the model call of a gateway transcript,
the message of a chat one); the role and excerpt are of that entry's first differing unit;
a side whose transcript already ended reads role `(none)` and excerpt "".
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

EXCERPT = 80  # characters of each side's excerpt

Unit = tuple[str, str, tuple[tuple[str, str], ...]]


class TranscriptDiff(BaseModel):
    """Where one example's transcripts (each step's first sample) first differ."""

    model_config = ConfigDict(frozen=True)

    example_id: int
    turn: int
    role_a: str
    role_b: str
    excerpt_a: str
    excerpt_b: str


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _calls(calls: Any) -> tuple[tuple[str, str], ...]:
    out = []
    for c in calls or []:
        fn = c.get("function") if isinstance(c, dict) else None
        fn = fn if isinstance(fn, dict) else (c if isinstance(c, dict) else {})
        out.append((_text(fn.get("name")), _text(fn.get("arguments"))))
    return tuple(out)


def _message(m: Any) -> Unit:
    m = m if isinstance(m, dict) else {"content": m}
    return _text(m.get("role")), _text(m.get("content")), _calls(m.get("tool_calls"))


def units(entry: Any) -> list[Unit]:
    """What one transcript entry said, as compared (see the module docstring)."""
    if not isinstance(entry, dict) or "route" not in entry:
        return [_message(entry)]
    if isinstance(entry.get("messages"), list):
        request = [_message(m) for m in entry["messages"]]
    else:
        prompt = next((entry[k] for k in ("prompt", "text", "input_ids") if k in entry), None)
        request = [("prompt", _text(prompt), ())]
    return [*request, ("assistant", _text(entry.get("text")), _calls(entry.get("tool_calls")))]


def _excerpt(unit: Unit | None) -> str:
    if unit is None:
        return ""
    _, text, calls = unit
    if calls:
        text = f"{text} " + " ".join(f"{name}({args})" for name, args in calls)
    one_line = text.strip().replace("\n", "\\n")
    return one_line if len(one_line) <= EXCERPT else one_line[: EXCERPT - 1] + "…"


def _entries(row: dict[str, Any]) -> list[Any] | None:
    raw = row.get("messages")  # absent: a file written before transcripts were kept
    return None if raw is None else list(json.loads(raw))


def transcript_diff(example_id: int, a: dict[str, Any], b: dict[str, Any]) -> TranscriptDiff | None:
    """Where samples rows `a` and `b`'s transcripts first differ; None when they say the same or
    either has none."""
    ea, eb = _entries(a), _entries(b)
    if ea is None or eb is None:
        return None
    ua, ub = [units(e) for e in ea], [units(e) for e in eb]
    if ua == ub:
        return None
    turn = next((i for i, (x, y) in enumerate(zip(ua, ub, strict=False)) if x != y), min(len(ua), len(ub)))
    xa = ua[turn] if turn < len(ua) else []
    xb = ub[turn] if turn < len(ub) else []
    k = next((i for i, (x, y) in enumerate(zip(xa, xb, strict=False)) if x != y), min(len(xa), len(xb)))
    pa_ = xa[k] if k < len(xa) else None
    pb_ = xb[k] if k < len(xb) else None
    return TranscriptDiff(example_id=example_id, turn=turn, role_a=pa_[0] if pa_ else "(none)",
                          role_b=pb_[0] if pb_ else "(none)", excerpt_a=_excerpt(pa_), excerpt_b=_excerpt(pb_))
