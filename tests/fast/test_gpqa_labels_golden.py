"""gpqa as miles' own code grades it for two label families outside the public golden table.

tests/data/gpqa_labels_golden.jsonl holds miles' `compute_gpqa_reward` (31f1ca9) run unmodified on
every case of `tests/data/gpqa_labels_golden.py` (how it was produced is in that file): labels
miles reads as numbers (an index, truncated, into the valid letters) and string labels that are
not a choice letter (the option's text, `(C)`, `C.`, a letter outside the valid ones). A row
agrees when pinned-eval's `gpqa` returns miles' value exactly, or refuses the row
(`RewardRefused`) where miles raised.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pinned_eval.scoring.rewards import RewardRefused, get_reward

DATA = Path(__file__).resolve().parents[1] / "data"
ROWS: list[dict[str, Any]] = [
    json.loads(line) for line in (DATA / "gpqa_labels_golden.jsonl").read_text(encoding="utf-8").splitlines()
]


def test_the_table_covers_both_families_with_every_outcome() -> None:
    outcomes = Counter((r["id"].split("-")[0], r["raises"] or r["miles_reward"]) for r in ROWS)
    assert outcomes == {
        ("numeric", 0.0): 1600, ("numeric", 1.0): 272, ("numeric", "ValueError"): 144,
        ("numeric", "OverflowError"): 144, ("text", 0.0): 1528, ("text", 1.0): 479, ("text", "IndexError"): 9,
    }


@pytest.mark.parametrize("family", ["numeric", "text"])
def test_gpqa_agrees_with_miles_on_every_row(family: str) -> None:
    gpqa = get_reward("gpqa")
    diffs = []
    for row in (r for r in ROWS if r["id"].startswith(family + "-")):
        metadata = json.loads(json.dumps(row["metadata"]))  # miles got a copy too; ours must not need one
        try:
            got: object = gpqa(row["response"], row["label"], metadata)
        except RewardRefused as exc:
            got = exc
        ok = isinstance(got, RewardRefused) if row["raises"] else got == row["miles_reward"]
        if not ok or metadata != row["metadata"]:
            diffs.append(f"{row['id']}: miles {row['raises'] or row['miles_reward']}, pinned-eval {got!r:.80} "
                         f"| response={row['response']!r} label={row['label']!r} metadata={row['metadata']}")
    assert not diffs, f"{len(diffs)} rows disagree:\n" + "\n".join(diffs[:40])


def test_boxed_gpqa_grades_the_last_box_like_gpqa_for_both_families() -> None:
    gpqa, boxed = get_reward("gpqa"), get_reward("boxed_gpqa")
    for row in ROWS[::7]:
        if row["raises"] is None:
            assert boxed(f"work \\boxed{{{row['response']}}}", row["label"], row["metadata"]) == row["miles_reward"]
            assert gpqa(row["response"], row["label"], row["metadata"]) == row["miles_reward"]
