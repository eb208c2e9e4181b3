"""The demo's closing output: the table, and one line per point it could not measure (with why)."""

from __future__ import annotations

from app.demo.run import _row, _unmeasured, render_table
from trainer_integration.results import PointOutcome

OUTCOMES = [
    PointOutcome(step=0, state="measured", metrics={"arith": {"eval/arith": 0.5, "eval/lag_steps": 3.0}}),
    PointOutcome(step=100, state="failed", reason="crashed", message="Flow run encountered an exception: 503"),
    PointOutcome(step=200, state="skipped", reason="busy", message="step 200: eval-inflight-demo is full"),
]


def test_every_unmeasured_point_gets_a_line_with_its_reason_and_message() -> None:
    assert _unmeasured(OUTCOMES) == [
        "step 100: failed (crashed): Flow run encountered an exception: 503",
        "step 200: skipped (busy): step 200: eval-inflight-demo is full",
    ]


def test_the_table_has_one_row_per_point_and_no_message_column() -> None:
    lines = render_table([_row(o) for o in OUTCOMES]).splitlines()
    assert lines[0].split() == ["step", "state", "arith", "weight_version", "lag", "reason"]
    assert [line.split()[:2] for line in lines[1:]] == [["0", "measured"], ["100", "failed"], ["200", "skipped"]]
    assert lines[1].split()[2:] == ["0.500", "-", "3"]
