"""The CLI's process ends cleanly: `compare` printed its answer and then aborted (exit 134,
"terminate called without an active exception") in 1 run of 5; every run here must exit 0 with
nothing on stderr. Real Prefect server, a real results store, `python -m app.cli` subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from blocks import SinksBlock
from pinned_eval.results.store import SAMPLES
from pinned_eval.results.tables import generation_row, samples_table

pytestmark = pytest.mark.e2e
RUNS = int(os.environ.get("PINNED_EVAL_COMPARE_RUNS", "5"))


def _gen(prompt_index: int, response: str) -> dict[str, object]:
    return {"dataset": "arith", "prompt_index": prompt_index, "sample_index": 0, "prompt": f"{prompt_index}+1=",
            "label": str(prompt_index + 1), "metadata": {}, "response": response, "response_len": 1,
            "finish_reason": "stop", "weight_version": "1"}


@pytest.mark.timeout(600)
def test_compare_exits_0_every_time_in_a_fresh_process(prefect_server: str, tmp_path: Path) -> None:
    sinks = SinksBlock(jsonl_path=str(tmp_path / "m.jsonl"), results_root=str(tmp_path / "results"))
    sinks.save("compare-exit", overwrite=True)
    store = sinks.results_store()
    assert store is not None
    rows_a = [{**generation_row(_gen(i, str(i + 1))), "reward": 1.0} for i in range(3)]  # all right
    rows_b = [{**generation_row(_gen(i, "0")), "reward": 1.0 if i else 0.0} for i in range(3)]  # 0 flipped
    store.write("exp", 1, SAMPLES, samples_table(rows_a, key=None))
    store.write("exp", 2, SAMPLES, samples_table(rows_b, key=None))
    env = dict(os.environ, PINNED_EVAL_HOME=str(tmp_path / "home"), PREFECT_API_URL=prefect_server)
    outcomes = []
    for _ in range(RUNS):
        done = subprocess.run([sys.executable, "-m", "app.cli", "compare", "exp", "1", "2", "--sinks", "compare-exit",
                               "--json"], env=env, capture_output=True, text=True, timeout=120)
        outcomes.append((done.returncode, done.stderr))
        assert '"prompt": "0+1="' in done.stdout, done.stdout + done.stderr
    assert outcomes == [(0, "")] * RUNS
