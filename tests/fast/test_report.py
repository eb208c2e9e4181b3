"""Status table and report figure from a hand-built history (no server)."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from app.history import Attempt, PointHistory, RunHistory
from app.report import format_table, html_report, plot_history, status_rows, write_report


def _attempt(n: int, kind: str, name: str) -> Attempt:
    return Attempt(flow_run_id=f"fr-{n}", number=n, state_type=kind, state_name=name)


HISTORY = RunHistory(
    run="exp42",
    points=[
        PointHistory(run="exp42", step=10, outcome="measured", weight_version="10", lag_steps=1.0,
                     scores={"add": 0.4, "sub": 0.2}, attempts=[_attempt(1, "COMPLETED", "Completed")]),
        PointHistory(run="exp42", step=20, outcome="skipped", reason="busy",
                     attempts=[_attempt(1, "COMPLETED", "Skipped")]),
        PointHistory(run="exp42", step=30, outcome="measured", weight_version="30", lag_steps=3.0,
                     scores={"add": 0.6, "sub": 0.5},
                     attempts=[_attempt(1, "FAILED", "Failed"), _attempt(2, "COMPLETED", "Completed")]),
        PointHistory(run="exp42", step=40, outcome="crashed", reason="crashed",
                     attempts=[_attempt(1, "CRASHED", "Crashed")]),
        PointHistory(run="exp42", step=50, outcome="skipped", reason="pin_violation"),
    ],
)


def test_status_rows_have_a_column_per_dataset():
    rows = status_rows(HISTORY)
    assert rows[2] == {"step": 30, "state": "measured", "reason": None, "eval/add": 0.6, "eval/sub": 0.5,
                       "weight_version": "30", "lag_steps": 3.0, "attempts": 2}
    assert rows[1]["eval/add"] is None and rows[1]["reason"] == "busy"
    json.dumps(rows)  # machine-readable as is


def test_table_text_lists_every_step():
    lines = format_table(HISTORY).splitlines()
    assert lines[0].split() == ["step", "state", "reason", "eval/add", "eval/sub", "weight_version", "lag_steps",
                                "attempts"]
    assert [line.split()[:3] for line in lines[1:]] == [
        ["10", "measured", "-"], ["20", "skipped", "busy"], ["30", "measured", "-"], ["40", "crashed", "crashed"],
        ["50", "skipped", "pin_violation"],
    ]
    assert format_table(RunHistory(run="empty")) == "run empty: no eval points"


def test_plot_draws_scores_skips_and_failures():
    fig = plot_history(HISTORY)
    [ax] = fig.axes
    lines = {line.get_gid(): line for line in ax.get_lines()}
    assert list(lines["score:add"].get_xdata()) == [10, 30]
    assert list(lines["score:sub"].get_ydata()) == [0.2, 0.5]
    marks = {c.get_gid(): c for c in ax.collections}
    assert [x for x, _ in marks["skipped"].get_offsets()] == [20, 50]
    assert [x for x, _ in marks["failed"].get_offsets()] == [40]
    notes = {t.get_gid(): t.get_text() for t in ax.texts}
    assert notes == {"skip-reason:20": "busy", "skip-reason:50": "pin_violation", "fail-reason:40": "crashed"}
    assert ax.get_ylim()[0] < 0.2  # room below the lowest score for the markers


def test_png_and_html_reports(tmp_path):
    png = write_report(HISTORY, tmp_path / "r.png")
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size == (1000, 550)
    page = write_report(HISTORY, tmp_path / "r.html").read_text()
    assert "data:image/png;base64," in page and page.count("<tr class=") == 5
    assert html_report(RunHistory(run="e")).count("<tr") == 1
    with pytest.raises(ValueError, match="out"):
        write_report(HISTORY, tmp_path / "r.svg")
