"""A dataset file that is not UTF-8 is a bad row naming the file, the line and the byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from pinned_eval.suite import DatasetError, DatasetSpec, EvalSuite, load_dataset


def _load(path: Path) -> object:
    return load_dataset(EvalSuite(datasets=(DatasetSpec(name="rows", path=str(path)),)).resolved()[0])


@pytest.mark.parametrize(
    ("line2", "column", "byte"),
    [
        (b'{"prompt": "caf\xe9", "label": "1"}\n', 16, 0xE9),  # latin-1, not UTF-8
        (b'{"prompt": "1+1=", "label": "\xff"}\n', 30, 0xFF),
        (b'{"prompt": "\xe2\x82", "label": "2"}\n', 13, 0xE2),  # a cut multi-byte sequence
    ],
)
def test_non_utf8_line_is_a_dataset_error_naming_file_line_and_byte(
    tmp_path: Path, line2: bytes, column: int, byte: int
) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes('{"prompt": "½+½=", "label": "1"}\n'.encode() + line2 + b'{"prompt": "x", "label": "y"}\n')
    with pytest.raises(DatasetError) as info:
        _load(path)
    assert str(info.value) == f"{path}: line 2: not UTF-8 text (byte 0x{byte:02x} at byte column {column})"


def test_utf8_with_any_line_endings_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes('{"prompt": "½+½=", "label": "1"}\r\n\r\n{"prompt": "é", "label": 2}\n'.encode())
    assert [(s.index, s.prompt, s.label) for s in _load(path)] == [(0, "½+½=", "1"), (1, "é", 2)]  # type: ignore[attr-defined]  # labels keep their JSON type
