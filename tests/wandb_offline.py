"""Read the history rows of W&B offline run files (`run-<id>.wandb`), to check what the sink logged.

The file is W&B's record log: a 7-byte header (":W&B", magic, version), then LevelDB-style
records in 32 KiB blocks (crc32, little-endian length, type FULL/FIRST/MIDDLE/LAST), each a
`wandb_internal_pb2.Record`. wandb 0.31 ships no Python reader for it.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes) -> Iterator[bytes]:
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def _file_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for raw in _records(path.read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        out.append(rec)
    return out


def _finished_files(wandb_dir: Path, timeout_s: float = 30.0) -> list[list[Any]]:
    """Records of every offline run file, once each ends with its `exit` record: W&B's service
    process writes a file after `finish()` has returned, so a file read at once may lack records.
    Past `timeout_s` the files are returned as they are (the caller's assertion says what is missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = [_file_records(p) for p in sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))]
        done = all(recs and recs[-1].WhichOneof("record_type") == "exit" for recs in files)
        if done or time.monotonic() > deadline:
            return files
        time.sleep(0.1)


def _parsed(wandb_dir: Path) -> Iterator[Any]:
    for recs in _finished_files(wandb_dir):
        yield from recs


def runs(wandb_dir: Path) -> list[dict[str, str]]:
    """The run record of every offline run file: id, group, job type."""
    return [
        {"id": r.run.run_id, "group": r.run.run_group, "job_type": r.run.job_type}
        for r in _parsed(wandb_dir)
        if r.WhichOneof("record_type") == "run"
    ]


def metric_definitions(wandb_dir: Path) -> set[tuple[str, str]]:
    """(name or glob, step metric) of every `define_metric` record."""
    return {
        (r.metric.name or r.metric.glob_name, r.metric.step_metric)
        for r in _parsed(wandb_dir)
        if r.WhichOneof("record_type") == "metric"
    }


def history_rows(wandb_dir: Path) -> list[dict[str, Any]]:
    """Every logged history row of every offline run under `wandb_dir`, in file order."""
    rows = []
    for rec in _parsed(wandb_dir):
        if rec.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def logged_tables(wandb_dir: Path) -> dict[str, dict[str, Any]]:
    """Every logged W&B table, history key -> {"columns": [...], "data": [[...], ...]} (from the
    table file the history row references, under the offline run's `files/`)."""
    out = {}
    for run_dir in sorted(Path(wandb_dir).glob("wandb/offline-run-*")):
        for rec in _parsed_file(run_dir):
            if rec.WhichOneof("record_type") != "history":
                continue
            for i in rec.history.item:  # a table is flattened: (name, "path") -> media/table/....table.json
                keys = list(i.nested_key)
                value = json.loads(i.value_json)
                if len(keys) == 2 and keys[1] == "path" and str(value).endswith(".table.json"):
                    out[keys[0]] = json.loads((run_dir / "files" / value).read_text())
    return out


def _parsed_file(run_dir: Path) -> list[Any]:
    _finished_files(run_dir.parent.parent)  # waits for every run file to end with its exit record
    return [r for p in sorted(run_dir.glob("run-*.wandb")) for r in _file_records(p)]
