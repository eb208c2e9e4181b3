"""What a point's gateway records: one `CallRecord` per call, and each sample's transcript.

Contract:
- `CallRecord`: `route` (the route template, e.g. `/sessions/{id}/v1/chat/completions`),
  `sample_key` (None for calls of no sample), `status` (the HTTP status answered), `weight_version`
  (the version the reply names; None when there was no reply), `prompt_tokens` /
  `completion_tokens` (as the reply counts them), `latency_s` (in the gateway, forwarding included),
  `error` (the refusal message, None when the call was forwarded).
- a transcript entry (`transcript_entry`): `route`, `status`, the request's `messages` / `prompt` /
  `text` / `input_ids` / `tools` (those it has), the reply's `text` (`/generate` text, the first
  choice's `text` or message `content`), `tool_calls` (the first choice's, [] when none),
  `finish_reason`, `weight_version`, `prompt_tokens`, `completion_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pinned_eval.rollout.session import reply_tokens

__all__ = ["CallRecord", "SampleState", "transcript_entry"]

_REQUEST_KEYS = ("messages", "prompt", "text", "input_ids", "tools")


@dataclass
class CallRecord:
    """One call the gateway answered (see the module docstring)."""

    route: str
    sample_key: str | None
    status: int
    weight_version: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None

    def fill(self, payload: Any) -> None:
        """Take the version and token counts from a reply."""
        first = payload[0] if isinstance(payload, list) and payload else payload
        if isinstance(first, dict):
            info = first.get("meta_info") if "meta_info" in first else first.get("metadata")
            version = info.get("weight_version") if isinstance(info, dict) else None
            self.weight_version = version if isinstance(version, str) else None
        self.prompt_tokens, self.completion_tokens = reply_tokens(payload)


@dataclass
class SampleState:
    """One sample's counts, deadline origin and transcript."""

    key: str
    opened: float  # time.monotonic() when opened (or first seen)
    session_id: str | None = None
    turns: int = 0
    tokens: int = 0
    breach: str | None = None
    closed: bool = False  # DELETE /sessions/{id}: no call is admitted afterwards
    transcript: list[dict[str, Any]] = field(default_factory=list)


def _reply_parts(payload: Any) -> tuple[str | None, list[Any], Any]:
    if not isinstance(payload, dict):
        return None, [], None
    if "choices" in payload:
        choices = payload.get("choices") or [{}]
        first = choices[0] if isinstance(choices[0], dict) else {}
        message: dict[str, Any] = first["message"] if isinstance(first.get("message"), dict) else {}
        text = first.get("text", message.get("content"))
        return text, list(message.get("tool_calls") or []), first.get("finish_reason")
    meta = payload.get("meta_info")
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    return payload.get("text"), [], reason.get("type") if isinstance(reason, dict) else reason


def transcript_entry(route: str, body: dict[str, Any], status: int, payload: Any, record: CallRecord) -> dict[str, Any]:
    """One transcript entry of a forwarded call (see the module docstring)."""
    text, tool_calls, finish = _reply_parts(payload)
    entry: dict[str, Any] = {"route": route, "status": status}
    entry.update({k: body[k] for k in _REQUEST_KEYS if k in body})
    entry.update(text=text, tool_calls=tool_calls, finish_reason=finish, weight_version=record.weight_version,
                 prompt_tokens=record.prompt_tokens, completion_tokens=record.completion_tokens)
    return entry
