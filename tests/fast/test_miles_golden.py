"""miles' own rewards, case for case: every row of tests/data/miles_rewards_golden.jsonl (outputs of
miles' rm_hub.async_rm at 31f1ca9, see docs/rewards.md) scored through the public entry point
`get_reward(rm_type)(response, label, metadata)`.

A row agrees when the reward equals miles' within 1e-9, or, where miles raised, when pinned-eval
refuses the row with `RewardRefused` (never a score). `python -m tests.fast.test_miles_golden` prints
the agreement table per rm type (any exception counts as a refusal there, as the golden file's rule).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pinned_eval.scoring.rewards import RewardRefused, check_reward_name, get_reward

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "miles_rewards_golden.jsonl"
ROWS: list[dict[str, Any]] = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines()]
# the miles rm types a math/QA eval uses; boxed_math, ifbench and exact_match have their own tests below
MILES_TYPES = ("math", "deepscaler", "gemma_math", "dapo", "boxed_dapo", "gpqa", "boxed_gpqa", "f1", "boxed_f1")


def score_row(row: dict[str, Any]) -> tuple[str, Any]:
    """("value", float) or ("refused", exception) for one golden row."""
    try:
        value = get_reward(row["rm_type"])(row["response"], row["label"], row["metadata"])
    except Exception as exc:
        return "refused", exc
    return "value", value


def agrees(row: dict[str, Any], outcome: tuple[str, Any], *, named: bool = True) -> bool:
    kind, got = outcome
    if row["raises"] is not None:
        return kind == "refused" and (isinstance(got, RewardRefused) or not named)
    return kind == "value" and got is not None and math.isclose(got, row["miles_reward"], rel_tol=0, abs_tol=1e-9)


def agreement_table(named: bool = False) -> dict[str, tuple[int, int]]:
    table: dict[str, tuple[int, int]] = {}
    for row in ROWS:
        ok, n = table.get(row["rm_type"], (0, 0))
        table[row["rm_type"]] = (ok + agrees(row, score_row(row), named=named), n + 1)
    return table


@pytest.mark.parametrize("rm_type", MILES_TYPES)
def test_golden_rows_agree_with_miles(rm_type: str) -> None:
    rows = [r for r in ROWS if r["rm_type"] == rm_type]
    assert rows, f"no golden rows for {rm_type}"
    diffs = []
    for row in rows:
        outcome = score_row(row)
        if not agrees(row, outcome):
            want = f"raises {row['raises']}" if row["raises"] else row["miles_reward"]
            diffs.append(f"{row['id']}: miles {want}, pinned-eval {outcome[0]} {outcome[1]!r:.120}"
                         f" | response={row['response']!r:.80} label={row['label']!r:.40}")
    assert not diffs, f"{rm_type}: {len(rows) - len(diffs)}/{len(rows)} agree\n" + "\n".join(diffs)


def test_labels_reach_the_reward_with_their_json_type(tmp_path: Path) -> None:
    """Through the dataset loader too (what a real point scores): a numeric label stays a number."""
    from pinned_eval.datasets.loader import load_dataset
    from pinned_eval.suite import DatasetSpec, EvalSuite

    rows = [r for r in ROWS if r["rm_type"] in MILES_TYPES]
    path = tmp_path / "golden.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["id"], "label": r["label"], "meta": r["metadata"]}) + "\n"
                            for r in rows), encoding="utf-8")
    [ds] = EvalSuite(datasets=(DatasetSpec(name="g", path=str(path), reward="f1", metadata_key="meta"),)).resolved()
    loaded = load_dataset(ds)
    assert [(s.label, type(s.label)) for s in loaded] == [(r["label"], type(r["label"])) for r in rows]
    diffs = [r["id"] for r, s in zip(rows, loaded, strict=True)
             if not agrees(r, score_row({**r, "label": s.label, "metadata": s.metadata}))]
    assert not diffs


def test_boxed_math_keeps_the_sane_result() -> None:
    """miles' boxed_math scores 0 on every row (it hands the box's content to `math`, which needs a
    box): pinned-eval grades the last box like `math` instead (documented divergence)."""
    rows = [r for r in ROWS if r["rm_type"] == "boxed_math"]
    assert len(rows) == 65 and all(r["miles_reward"] == 0.0 for r in rows)
    boxed_math, plain = get_reward("boxed_math"), get_reward("math")
    scores = [boxed_math(r["response"], r["label"], r["metadata"]) for r in rows]
    assert scores == [plain(r["response"], r["label"], r["metadata"]) for r in rows]
    assert sum(scores) > 0  # the divergence is real on this sample


def test_ifbench_is_refused_naming_why() -> None:
    with pytest.raises(ValueError, match=r"ifbench.*IFBench"):
        check_reward_name("ifbench")


def test_exact_match_is_not_a_miles_rm_type() -> None:
    """miles raises NotImplementedError for exact_match; pinned-eval keeps it as its own extension
    and refuses it when asked to read configs strictly as miles does."""
    assert all(r["raises"] == "NotImplementedError" for r in ROWS if r["rm_type"] == "exact_match")
    with pytest.raises(ValueError, match="not a miles rm_type"):
        check_reward_name("exact_match", strict_miles=True)
    assert check_reward_name("exact_match") == "exact_match"


def test_a_refused_row_skips_the_point_as_reward_unavailable() -> None:
    from pinned_eval.skip_mapping import skip_for

    [row] = [r for r in ROWS if r["id"] == "dapo-26"]  # label 'five': miles raises ValueError
    kind, exc = score_row(row)
    assert kind == "refused" and skip_for(exc) == ("reward_unavailable", str(exc))


def test_a_power_tower_is_not_evaluated() -> None:
    assert get_reward("math")("\\boxed{9**9**9**9}", "1") == 0.0


if __name__ == "__main__":
    for name, (ok, n) in sorted(agreement_table().items()):
        print(f"| {name} | {ok} / {n} |")
