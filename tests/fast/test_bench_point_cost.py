"""`python -m bench point_cost`: its arguments, its table and its probe plumbing, without a server."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import point_cost
from bench.__main__ import plan
from bench.checkouts import run_probe


def test_point_cost_is_a_bench_module_taking_its_own_arguments() -> None:
    assert plan(["point_cost", "--base", "abc1234", "--points", "3"]) == [
        ("point_cost", ["--base", "abc1234", "--points", "3"])
    ]


def test_the_base_revision_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        point_cost.main(["--points", "3"])
    assert exc.value.code == 2
    assert "the following arguments are required: --base" in capsys.readouterr().err


def test_a_call_is_its_method_and_path_with_ids_elided() -> None:
    api = "http://127.0.0.1:4200/api"
    url = f"{api}/flow_runs/0f6a3c1e-1d2b-4c3d-9e8f-0123456789ab/set_state?x=1"
    assert point_cost._call("POST", url, api) == "POST /flow_runs/{id}/set_state"


def test_table_shows_exact_counts_ratios_and_the_calls_that_differ() -> None:
    def side(requests: list[int], wall: list[float], calls: list[dict[str, int]], busy: list[int],
             end_wait: list[float]) -> dict[str, list[object]]:
        n = len(requests)
        return {"requests": requests, "task_runs": [7] * n, "artifacts": [2] * n, "logs": [1, 2, 1][:n],
                "wall": wall, "calls": calls, "locked": [0] * n, "busy": busy, "other_busy": [0] * n,
                "end_wait": end_wait}

    same = {"POST /b": 1}
    samples = {  # GET /a: once more per point in this tree; POST /c: retried in one base point, absent here
        "base": side([40, 40, 41], [2.0, 4.0, 3.0],
                     [{"GET /a": 2, **same}] * 2 + [{"GET /a": 2, "POST /c": 1, **same}], [0, 1, 0], [0.5, 0.2, 0.9]),
        "this tree": side([41, 41, 41], [3.0, 3.3, 9.0], [{"GET /a": 3, **same}] * 3, [0, 0, 0], [0.1, 0.3, 0.2]),
    }
    assert point_cost.table(samples, "11ae352") == [  # type: ignore[arg-type]
        "base 11ae352 vs this tree; 3 points each",
        "measure                         base   this tree   ratio",
        "api requests/point             40-41          41    1.02",
        "task runs/point                    7           7    1.00",
        "artifacts/point                    2           2    1.00",
        "log posts/point                  1-2         1-2    1.00",
        "slot 423s/point                    0           0       -",
        "slot 503s/point                  0-1           0       -",
        "other 503s/point                   0           0       -",
        "wall s/point (median)           3.00        3.30    1.10",
        "s after final state (med.)      0.50        0.20    0.40",
        "wall s, no 503 (median)         2.50        3.30  (2 and 3 points)",
        "wall s, a 503 (median)          4.00           -  (1 and 0 points)",
        "  differs: GET /a: 2 -> 3",
        "  differs: POST /c: 0-1 -> 0",
    ]


def test_a_failing_probe_is_one_error_naming_its_checkout(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text("import sys; sys.stderr.write('boom'); sys.exit(3)\n")
    with pytest.raises(SystemExit, match=rf"probe failed in {tmp_path}:\nboom"):
        run_probe(tmp_path, script, [])
