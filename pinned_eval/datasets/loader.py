"""Load eval dataset rows (JSONL or Parquet) into typed `EvalSample`s.

Contract:
- `EvalSample.index` is the 0-based position among the loaded rows (blank JSONL lines skipped);
  `max_prompts` keeps the first N rows.
- `prompt` is a string, or (only with `apply_chat_template`) a list of `{role, content}` messages.
- `label` keeps its JSON type, a string or a number (JSON `7` stays the int 7), as miles hands it
  to its rewards (an int `0` label scores 0 in `math`; an int label is refused by `f1`); an object
  or a list (search-r1's `{"ground_truth": ...}`) only where something reads the raw value
  (`reads_structured_labels`: a custom reward, `remote_rm`, a generate function), else a
  `DatasetError` naming the key and the reward.
- `metadata`: with `metadata_key`, the row's object under that key (a mapping, or a JSON object
  string as Parquet exports often hold; null is {}; the key must exist); without it, every other column of
  the row, unchanged. `metadata_overrides` are then set on it (miles `inject_metadata`).
- tools (miles `tool_key`, default `tools`): when the row has that key and it is not null, its
  value (a list of OpenAI tool specs, or a JSON string of one) becomes `EvalSample.tools` and
  `metadata["tools"]`, as miles' `Dataset` does; the chat template then receives them
  (`pinned_eval.prompts`). A value that is not a list is a `DatasetError` naming the key.
- a `kind: lm_eval` dataset has one row per lm-eval task (`prompt` the task name, `label` a
  digest of the task directory's files and the lm-eval options, so the generation cache key
  changes when a task file does); lm-eval loads the documents itself (`pinned_eval.harness`).
- Any bad row raises `DatasetError` naming the file, the JSONL line (1-based) or Parquet row
  (0-based), and the offending key. Nothing is skipped silently. A JSONL line that is not UTF-8
  is such a bad row (named by line and byte column), as is JSON that is not.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.scoring.answers import Label

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; the message names file, line/row and key."""


@dataclass(frozen=True, slots=True)
class EvalSample:
    """One prompt of an eval dataset."""

    index: int
    prompt: str | list[dict[str, Any]]
    label: Label
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None


def reads_structured_labels(spec: ResolvedDataset) -> bool:
    """Whether `spec`'s rows may carry an object or list label (miles hands the raw JSON value to
    custom rewards and generate functions; pinned-eval's built-in rewards read strings and numbers)."""
    return spec.generate_function is not None or spec.reward.startswith("custom:") or spec.reward == "remote_rm"


def load_dataset(spec: ResolvedDataset) -> list[EvalSample]:
    """Read `spec.path` and return its prompts (at most `spec.max_prompts`)."""
    if spec.kind == "lm_eval":
        return _lm_eval_rows(spec)
    if spec.path is None:
        raise DatasetError(f"dataset {spec.name!r}: no path")
    path = Path(spec.path)
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found (dataset {spec.name!r})")
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        rows = _jsonl_rows(path)
    elif name.endswith(PARQUET_SUFFIXES):
        rows = _parquet_rows(path)
    else:
        raise DatasetError(f"{path}: unsupported extension (use {JSONL_SUFFIXES + PARQUET_SUFFIXES})")
    samples: list[EvalSample] = []
    for where, row in rows:
        if spec.max_prompts is not None and len(samples) >= spec.max_prompts:
            break
        samples.append(_to_sample(len(samples), f"dataset {spec.name!r}: {path}: {where}", row, spec))
    if not samples:
        raise DatasetError(f"{path}: dataset {spec.name!r} has no rows")
    return samples


# bytes that are not UTF-8 decode to lone surrogates U+DC80..U+DCFF under "surrogateescape";
# valid UTF-8 never yields them, so one in a line marks the exact bad byte
_UNDECODABLE = re.compile("[\udc80-\udcff]")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8", errors="surrogateescape") as fh:
        for lineno, line in enumerate(fh, start=1):
            if bad := _UNDECODABLE.search(line):
                byte = ord(bad.group()) - 0xDC00
                column = len(line[: bad.start()].encode("utf-8", "surrogateescape")) + 1
                raise DatasetError(f"{path}: line {lineno}: not UTF-8 text (byte 0x{byte:02x} at byte column {column})")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: line {lineno}: invalid JSON ({exc.msg})") from exc
            except RecursionError:  # deep nesting exhausts the stdlib parser's stack
                raise DatasetError(f"{path}: line {lineno}: invalid JSON (nested too deeply)") from None
            yield f"line {lineno}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa  # imported lazily: only Parquet datasets need it
    import pyarrow.parquet as pq  # pyarrow: slow import, only for Parquet datasets

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: cannot read Parquet ({exc})") from exc
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", row


def _to_sample(index: int, where: str, row: Any, spec: ResolvedDataset) -> EvalSample:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
    for key in (spec.input_key, spec.label_key):
        if key not in row:
            raise DatasetError(f"{where}: missing key {key!r} (has {sorted(row)})")
    prompt = row[spec.input_key]
    if spec.apply_chat_template:
        if not (isinstance(prompt, str) or _is_messages(prompt)):
            raise DatasetError(
                f"{where}: key {spec.input_key!r} must be a string or a list of {{role, content}}"
            )
    elif not isinstance(prompt, str):
        raise DatasetError(
            f"{where}: key {spec.input_key!r} must be a string, got {type(prompt).__name__} "
            "(chat message lists need apply_chat_template)"
        )
    label = row[spec.label_key]
    structured = isinstance(label, dict | list)
    if isinstance(label, bool) or not isinstance(label, str | int | float | dict | list):
        raise DatasetError(f"{where}: key {spec.label_key!r} must be a string, a number, an object or a list, "
                           f"got {label!r:.80}")
    if structured and not reads_structured_labels(spec):
        raise DatasetError(
            f"{where}: key {spec.label_key!r} is a JSON {'object' if isinstance(label, dict) else 'list'}; reward "
            f"{spec.reward!r} needs a string or a number (a structured label is for a custom reward, remote_rm or "
            "a generate function)")
    metadata = _metadata(where, row, spec)
    tools = _tools(where, row, spec.tool_key)
    if tools is not None:
        metadata["tools"] = tools
    return EvalSample(index=index, prompt=prompt, label=label, metadata=metadata, tools=tools)


def _tools(where: str, row: dict[str, Any], key: str) -> list[dict[str, Any]] | None:
    raw = row.get(key)
    if raw is None:
        return None
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = None
    if hasattr(value, "tolist"):  # a numpy array read from Parquet
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DatasetError(f"{where}: key {key!r} (tool_key) must be a list of tool specs, got {raw!r:.80}")
    return [dict(t) for t in value]


def _metadata(where: str, row: dict[str, Any], spec: ResolvedDataset) -> dict[str, Any]:
    if spec.metadata_key is None:
        meta = {k: v for k, v in row.items() if k not in (spec.input_key, spec.label_key)}
    else:
        if spec.metadata_key not in row:
            raise DatasetError(f"{where}: missing metadata key {spec.metadata_key!r} (has {sorted(row)})")
        raw = row[spec.metadata_key]
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError:
                raw = None
        if raw is None and row[spec.metadata_key] is None:
            raw = {}
        if not isinstance(raw, dict):
            raise DatasetError(
                f"{where}: key {spec.metadata_key!r} must be an object (or a JSON object string), "
                f"got {row[spec.metadata_key]!r:.80}"
            )
        meta = dict(raw)
    return {**meta, **spec.metadata_overrides}


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )


def _lm_eval_rows(spec: ResolvedDataset) -> list[EvalSample]:
    digest = hashlib.sha256(json.dumps([spec.lm_eval_model, spec.num_fewshot, spec.max_prompts]).encode())
    if spec.task_dir is not None:
        root = Path(spec.task_dir)
        if not root.is_dir():
            raise DatasetError(f"dataset {spec.name!r}: task_dir {root} is not a directory")
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            digest.update(str(file.relative_to(root)).encode() + b"\0")
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    label = digest.hexdigest()
    return [EvalSample(index=i, prompt=task, label=label) for i, task in enumerate(spec.tasks)]
