"""`status` / `report` window options: which steps `--last` / `--since` ask for."""

from __future__ import annotations

import pytest

from app.commands.history import DEFAULT_LAST, window


@pytest.mark.parametrize(
    ("last", "since", "expected"),
    [
        (None, None, DEFAULT_LAST),  # the default view: the latest 50 steps
        (None, 100, None),  # --since alone: every step from there
        (0, None, None),  # --last 0: every step
        (7, 100, 7),  # both: the latest 7 at or after step 100
        (7, None, 7),
    ],
)
def test_the_window_of_steps_read(last: int | None, since: int | None, expected: int | None) -> None:
    assert window(last, since) == expected


def test_the_default_view_is_the_latest_50_steps() -> None:
    assert DEFAULT_LAST == 50
