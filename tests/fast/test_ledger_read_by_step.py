"""`Ledger.read(run, steps=..., min_step=...)`: the rows of a few points, in file order, without
parsing the other points' lines (those this module wrote: run and step first); every other line
is parsed and judged as by a full read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pinned_eval.sinks import Ledger, MetricRow


def _row(run: str, step: int, dataset: str = "add") -> MetricRow:
    return MetricRow(run=run, step=step, dataset=dataset, state="measured", metrics={f"eval/{dataset}": step / 10})


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    led = Ledger(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        led.write_point([_row("a", step), _row("a", step, "sub"), _row('b"q', step)])
    return led


def _keys(rows: list[MetricRow]) -> list[tuple[str, int, str | None]]:
    return [r.key for r in rows]


def test_a_filtered_read_returns_the_same_rows_as_a_full_read_filtered(ledger: Ledger) -> None:
    full = ledger.read()
    assert _keys(ledger.read("a", steps={2, 4})) == [r.key for r in full if r.run == "a" and r.step in (2, 4)]
    assert _keys(ledger.read("a", min_step=4)) == [("a", 4, "add"), ("a", 4, "sub"), ("a", 5, "add"), ("a", 5, "sub")]
    assert _keys(ledger.read('b"q', steps={1})) == [('b"q', 1, "add")]  # a quote in the run name
    assert _keys(ledger.read(steps={5})) == [("a", 5, "add"), ("a", 5, "sub"), ('b"q', 5, "add")]
    assert ledger.read("a", steps=set()) == []


def test_only_the_wanted_points_lines_are_parsed(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []
    real = MetricRow.model_validate_json

    def counting(data: Any, *args: Any, **kwargs: Any) -> MetricRow:
        parsed.append(bytes(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(MetricRow, "model_validate_json", counting)
    assert _keys(ledger.read("a", steps={3})) == [("a", 3, "add"), ("a", 3, "sub")]
    assert len(parsed) == 2  # of 15 lines
    parsed.clear()
    assert len(ledger.read("a")) == 10
    assert len(parsed) == 10  # the other run's lines are passed over too


def test_lines_not_written_here_are_parsed_and_bad_ones_noted(ledger: Ledger) -> None:
    with open(ledger.path, "ab") as f:
        f.write(b'{"run": "a", "step": 2, "dataset": "hand", "state": "measured"}\n')  # spaces: not passed over
        f.write(b'{"run": "a", "step": 9, "state": "meas\n')  # corrupt, written by no one here
        f.write(b'{"run":"a","step":3,"dataset":"cut", "sta\n')  # corrupt, starts as a row of step 3
    assert _keys(ledger.read("a", steps={2})) == [("a", 2, "add"), ("a", 2, "sub"), ("a", 2, "hand")]
    assert [b.split(": ")[0] for b in ledger.bad_lines] == [f"{ledger.path}:17"]  # step 3's line is not read
    ledger.read("a", steps={3})
    assert [b.split(": ")[0] for b in ledger.bad_lines] == [f"{ledger.path}:17", f"{ledger.path}:18"]
