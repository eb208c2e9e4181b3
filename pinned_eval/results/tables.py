"""The Parquet tables of a point: its generations (the cache) and its scored samples.

One row per (dataset, example, sample). Columns: `dataset`, `example_id` (the prompt's index in
the dataset), `sample_index`, `prompt` (as rendered and sent), `response` (the full generation
text as the engine returned it), `label` and `metadata` (JSON text, their types kept),
`weight_version`, `finish_reason`, `prompt_tokens`, `completion_tokens`; samples add `reward`
(null when the reward gave none).

Transcripts (agentic rollouts, `pinned_eval.rollout.Sample`'s optional fields): a table whose rows
carry any of them has the nullable columns `messages` and `tool_calls` (JSON text), `turns`,
`status` and `rollout_reward` (a reward the rollout itself set; `score` keeps it, as does a
rescore); a table without any (every single-turn point) has exactly the columns above, and files
written before these columns existed read back unchanged. The generation cache key is the file's schema metadata
`pinned_eval.generation_key`; a rescored samples file says `pinned_eval.rescored: true`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

KEY_META = b"pinned_eval.generation_key"
RESCORED_META = b"pinned_eval.rescored"

GENERATION_FIELDS = [
    pa.field("dataset", pa.string()),
    pa.field("example_id", pa.int64()),
    pa.field("sample_index", pa.int64()),
    pa.field("prompt", pa.string()),
    pa.field("response", pa.string()),
    pa.field("label", pa.string()),
    pa.field("metadata", pa.string()),
    pa.field("weight_version", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
]
SAMPLE_FIELDS = [*GENERATION_FIELDS[:5], pa.field("reward", pa.float64()), *GENERATION_FIELDS[5:]]
TRANSCRIPT_FIELDS = [
    pa.field("messages", pa.string()),
    pa.field("turns", pa.int64()),
    pa.field("tool_calls", pa.string()),
    pa.field("status", pa.string()),
    pa.field("rollout_reward", pa.float64()),
]
TRANSCRIPT_COLUMNS = tuple(f.name for f in TRANSCRIPT_FIELDS)
_JSON_COLUMNS = ("messages", "tool_calls")


def has_transcript(row: Mapping[str, Any]) -> bool:
    """Whether a table row carries any transcript column with a value."""
    return any(row.get(c) is not None for c in TRANSCRIPT_COLUMNS)


def _schema(fields: list[pa.Field], rows: list[Mapping[str, Any]], meta: dict[bytes, bytes]) -> pa.Schema:
    extra = TRANSCRIPT_FIELDS if any(has_transcript(r) for r in rows) else []
    return pa.schema([*fields, *extra], metadata=meta)


def generation_row(g: Mapping[str, Any]) -> dict[str, Any]:
    """A row from a generation's fields (`tasks.generate.Generation.model_dump()`)."""
    return {
        "dataset": g["dataset"],
        "example_id": g["prompt_index"],
        "sample_index": g["sample_index"],
        "prompt": g["prompt"],
        "response": g["response"],
        "label": json.dumps(g["label"]),
        "metadata": json.dumps(g["metadata"], sort_keys=True),
        "weight_version": g["weight_version"],
        "finish_reason": g["finish_reason"],
        "prompt_tokens": g.get("prompt_tokens"),
        "completion_tokens": g["response_len"],
        **transcript_row(g),
    }


def transcript_row(g: Mapping[str, Any]) -> dict[str, Any]:
    """The transcript columns of a sample's fields; {} when it recorded none (a single-turn one)."""
    values = {"messages": g.get("messages"), "turns": g.get("turns"), "tool_calls": g.get("tool_calls"),
              "status": g.get("status"), "rollout_reward": g.get("reward")}
    if all(v is None for v in values.values()):
        return {}
    for c in _JSON_COLUMNS:
        if values[c] is not None:
            values[c] = json.dumps(values[c], sort_keys=True)
    return values


def decoded_transcript(row: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `transcript_row`: `Sample` fields (messages, turns, tool_calls, status, reward)
    of a table row; {} for a row of a table without transcript columns."""
    out: dict[str, Any] = {}
    for c in TRANSCRIPT_COLUMNS:
        if c in row:
            value = row[c]
            out["reward" if c == "rollout_reward" else c] = (
                json.loads(value) if c in _JSON_COLUMNS and value is not None else value
            )
    return out


def generation_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `generation_row`: keyword arguments of a `Generation`."""
    return {
        "dataset": row["dataset"],
        "prompt_index": row["example_id"],
        "sample_index": row["sample_index"],
        "prompt": row["prompt"],
        "label": json.loads(row["label"]),
        "metadata": json.loads(row["metadata"]),
        "response": row["response"],
        "response_len": row["completion_tokens"],
        "finish_reason": row["finish_reason"],
        "weight_version": row["weight_version"],
        "prompt_tokens": row["prompt_tokens"],
        **decoded_transcript(row),
    }


def generations_table(rows: Iterable[Mapping[str, Any]], key: str) -> pa.Table:
    data = list(rows)
    return pa.Table.from_pylist(data, schema=_schema(GENERATION_FIELDS, data, {KEY_META: key.encode()}))


def samples_table(rows: Iterable[Mapping[str, Any]], *, key: str | None, rescored: bool = False) -> pa.Table:
    """`rows`: generation rows with `reward` added."""
    meta = {RESCORED_META: b"true" if rescored else b"false"}
    if key is not None:
        meta[KEY_META] = key.encode()
    data = list(rows)
    return pa.Table.from_pylist(data, schema=_schema(SAMPLE_FIELDS, data, meta))


def table_key(table: pa.Table) -> str | None:
    """The generation cache key a table was written under (None: none recorded)."""
    meta = table.schema.metadata or {}
    value = meta.get(KEY_META)
    return value.decode() if value is not None else None


def is_rescored(table: pa.Table) -> bool:
    return (table.schema.metadata or {}).get(RESCORED_META) == b"true"
