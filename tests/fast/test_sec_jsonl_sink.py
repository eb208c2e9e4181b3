"""A bad line in the JSONL sink (corrupt, truncated, not UTF-8, another format) blocks nobody.

Decision (pinned_eval/sinks/ledger.py): readers skip it, appends leave it where it was and
compaction keeps it byte for byte there; readers and compaction warn naming the file and the line;
other runs' rows are read, appended and compacted as before.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pinned_eval.sinks import JsonlSink, MetricRow

CORRUPT = b'{"run": "other", "step": 3, "state": "meas\n'
NOT_UTF8 = b'{"run": "other", "step": 4, "state": "measured", "dataset": "\xff\xfe"}\n'
ANOTHER_FORMAT = b'{"run": "other", "step": 5, "state": "measured", "rows_v2": []}\n'
TRUNCATED = b'{"run": "other", "step": 6, "sta'  # last line cut short, no newline


def _row(run: str, step: int, value: float, dataset: str = "add") -> MetricRow:
    return MetricRow(run=run, step=step, dataset=dataset, state="measured", metrics={f"eval/{dataset}": value})


@pytest.fixture
def polluted(tmp_path: Path) -> Path:
    path = tmp_path / "metrics.jsonl"
    good = _row("other", 1, 0.5).model_dump_json().encode() + b"\n"
    path.write_bytes(good + CORRUPT + NOT_UTF8 + ANOTHER_FORMAT + TRUNCATED)
    return path


def test_a_bad_line_does_not_block_another_runs_write_or_read(
    polluted: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = JsonlSink(polluted)
    with caplog.at_level(logging.WARNING, logger="pinned_eval.sinks"):
        sink.write_point([_row("mine", 7, 0.25), _row("mine", 7, 0.75, "sub")])
    assert sink.bad_lines == [] and caplog.records == []  # a write does not read the file
    with caplog.at_level(logging.WARNING, logger="pinned_eval.sinks"):
        mine = sink.read("mine")
    assert [(p.split(": ")[0]) for p in sink.bad_lines] == [f"{polluted}:{n}" for n in (2, 3, 4, 5)]
    assert [r.message.split(":")[1] for r in caplog.records] == ["2", "3", "4", "5"]
    assert all(str(polluted) in r.getMessage() for r in caplog.records)

    assert [(r.dataset, r.metrics) for r in mine] == [("add", {"eval/add": 0.25}), ("sub", {"eval/sub": 0.75})]
    assert [(r.run, r.step) for r in JsonlSink(polluted).read()] == [("other", 1), ("mine", 7), ("mine", 7)]


def test_bad_lines_are_kept_byte_for_byte_in_place_across_rewrites(
    polluted: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = JsonlSink(polluted)
    sink.write_point([_row("mine", 7, 0.25)])
    sink.write_point([_row("mine", 7, 1.0)])  # a rerun replaces its row, nothing else
    sink.write_point([_row("other", 1, 0.0)])  # the other run's good row is replaced, its bad lines stay
    bad = [CORRUPT, NOT_UTF8, ANOTHER_FORMAT, TRUNCATED + b"\n"]
    assert polluted.read_bytes().splitlines(keepends=True)[1:5] == bad  # appends leave them in place
    assert [r.metrics["eval/add"] for r in sink.read()] == [1.0, 0.0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pinned_eval.sinks"):
        assert sink.compact()  # 2 of 4 rows dead: the file rewritten without them
    assert [r.message.split(":")[1] for r in caplog.records] == ["2", "3", "4", "5"]
    lines = polluted.read_bytes().splitlines(keepends=True)
    assert lines[:4] == [CORRUPT, NOT_UTF8, ANOTHER_FORMAT, TRUNCATED + b"\n"]
    assert [MetricRow.model_validate_json(line).key for line in lines[4:]] == [("mine", 7, "add"), ("other", 1, "add")]
    assert [r.metrics["eval/add"] for r in sink.read()] == [1.0, 0.0]


def test_a_clean_file_has_no_bad_lines_and_rows_carry_sink_errors_only_when_set(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "m.jsonl")
    failed = _row("r", 1, 0.5).model_copy(update={"sink_errors": {"wandb": "OSError: full"}})
    sink.write_point([failed, _row("r", 1, 0.5, "sub")])
    assert sink.read()[0].sink_errors == {"wandb": "OSError: full"}
    assert b"sink_errors" not in (tmp_path / "m.jsonl").read_bytes().splitlines()[1]
    assert sink.bad_lines == []
