"""examples/agentic loads as its README says: `pinned-eval suite miles examples/agentic/eval.yaml`
(no PYTHONPATH: the YAML's directory is the import root), both datasets agentic, the gateway
limits from the YAML. (It runs in a real flow run in tests/e2e/test_agentic_point.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import app
from pinned_eval.rollout.function import gateway_limits
from pinned_eval.suite import EvalSuite

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "agentic"


def test_example_suite_loads_through_suite_miles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert str(EXAMPLE) not in os.environ.get("PYTHONPATH", "")  # its directory is the import root
    monkeypatch.chdir(tmp_path)
    data = str(EXAMPLE / "data")
    shown = CliRunner().invoke(app, ["suite", "miles", str(EXAMPLE / "eval.yaml"), "--set", f"DATA_DIR={data}"])
    assert shown.exit_code == 0, shown.output
    datasets = json.loads(shown.stdout)
    assert [(d["name"], d["generate_function"], d["path"]) for d in datasets] == [
        ("retool_hub", "miles.rollout.generate_hub.multi_turn.generate", f"{data}/retool.jsonl"),
        ("retool_custom", "retool_generate.generate", f"{data}/retool.jsonl"),
    ]
    suite = EvalSuite.from_miles_yaml(EXAMPLE / "eval.yaml", variables={"DATA_DIR": data})
    limits = gateway_limits(suite.resolved())
    assert (limits.max_turns_per_sample, limits.sample_wall_s, limits.max_requests) == (8, 120.0, 2000)

