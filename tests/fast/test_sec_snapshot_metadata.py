"""A shard whose safetensors `__metadata__` holds a non-string value is incomplete, naming the key.

safetensors' loaders (the engine's) refuse such a header at load time; the completeness check
must say so first, as a typed `bad_header` naming the shard and the key, never `complete` and
never an exception.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from safetensors import SafetensorError, safe_open

from pinned_eval.snapshot.check import SnapshotProblem, check_snapshot


def _single_shard(d: Path, metadata: Any) -> Path:
    header = {"__metadata__": metadata, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    raw = json.dumps(header).encode()
    path = d / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
    return path


@pytest.mark.parametrize(
    ("value", "kind"),
    [(7, "int"), (1.5, "float"), ({"nested": "x"}, "dict"), (["a"], "list"), (True, "bool"), (None, "NoneType")],
)
def test_non_string_metadata_value_is_bad_header_naming_the_key(tmp_path: Path, value: Any, kind: str) -> None:
    path = _single_shard(tmp_path, {"format": "pt", "step_info": value})
    with pytest.raises(SafetensorError), safe_open(str(path), "pt") as f:  # as the engine's loader would
        f.metadata()
    result = check_snapshot(str(tmp_path), require_marker=False)
    assert result.complete is False
    assert result.problem is SnapshotProblem.BAD_HEADER
    assert result.detail == f"model.safetensors: __metadata__ key 'step_info': value is a {kind}, not a string"


@pytest.mark.parametrize("metadata", [0, [], "", False])
def test_falsy_non_object_metadata_is_bad_header(tmp_path: Path, metadata: Any) -> None:
    """`0`, `[]`, `""` used to pass as no metadata at all."""
    _single_shard(tmp_path, metadata)
    result = check_snapshot(str(tmp_path), require_marker=False)
    assert result.problem is SnapshotProblem.BAD_HEADER
    assert result.detail.startswith("model.safetensors: __metadata__ is not an object")


def test_string_metadata_and_absent_metadata_are_complete(tmp_path: Path) -> None:
    path = _single_shard(tmp_path, {"format": "pt", "note": "ok"})
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "ok"}
    assert check_snapshot(str(tmp_path), require_marker=False).complete is True
    _single_shard(tmp_path, None)
    assert check_snapshot(str(tmp_path), require_marker=False).complete is True
