"""`pinned-eval prune --run R --keep-last N`: a preview unless `--yes`; the latest N steps, steps in
flight, best-kept steps and a step's only record are never deleted; a point that went back in
flight after the plan is not deleted; `status` still lists a pruned step from the ledger.

Real Prefect server (the session fixture), points seeded over its REST API in final states, the
CLI in this process (typer's runner).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from prefect import get_client
from typer.testing import CliRunner

from app.cli import app
from app.history import read_history
from app.prune import apply_prune, plan_prune
from bench.history_seed import seed_points
from blocks import SinksBlock, StagingBlock
from flows.point_runs import point_flow_runs
from pinned_eval.sinks import Ledger, MetricRow
from tests.prefect_server import prefect_rest_client

pytestmark = pytest.mark.e2e


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def _left(run: str) -> list[tuple[int, str]]:
    with get_client(sync_client=True) as client:
        return sorted((int(fr.parameters["step"]), fr.state.type.value if fr.state else "-")
                      for fr in point_flow_runs(client, run))  # fmt: skip


def _set_state(http: object, run: str, step: int, state: str) -> None:
    by_name = {"flow_runs": {"name": {"any_": [f"{run}/step-{step}"]}}}
    fr = http.post("/flow_runs/filter", json=by_name).json()[0]  # type: ignore[attr-defined]
    body = {"state": {"type": state}, "force": True}
    http.post(f"/flow_runs/{fr['id']}/set_state", json=body).raise_for_status()  # type: ignore[attr-defined]


def test_prune_previews_then_deletes_only_what_the_policy_allows(prefect_server: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    run, sinks, staging = f"prune-{tag}", f"prune-sinks-{tag}", f"prune-staging-{tag}"
    ledger = Ledger(tmp_path / "metrics.jsonl")
    SinksBlock(jsonl_path=str(ledger.path)).save(sinks)
    StagingBlock(root=str(tmp_path / "staging"), keep_best=1, keep_best_metric="eval/arith").save(staging)
    params = {"sinks": sinks, "staging": staging}
    with prefect_rest_client(prefect_server) as http:
        seed_points(http, run, range(2, 3), "FAILED", parameters=params)  # step 2's first attempt
        seed_points(http, run, range(1, 9), parameters=params)
        _set_state(http, run, 5, "RUNNING")  # step 5 in flight
        # step 3 has no ledger row (its flow run is its only record); step 4 scores best
        ledger.write_point([MetricRow(run=run, step=s, dataset="arith", state="measured", weight_version=str(s),
                                      metrics={"eval/arith": 0.9 if s == 4 else s / 100})
                            for s in (1, 2, 4, 5, 6, 7, 8)])  # fmt: skip
        before = _left(run)
        assert len(before) == 9

        code, out = cli("prune", "--run", run, "--keep-last", "2")
        assert (code, out.splitlines()) == (0, [
            f"run {run}: 9 flow run(s); keeping the last 2 step(s) (steps 7..8)",
            "kept: 1 step(s) in flight (5), 1 best-kept step(s) (4)",
            "kept: the final flow run of 1 step(s) without ledger rows (their only record) (3)",
            "delete: 4 flow run(s) of 3 step(s) (1, 2, 6): 1 superseded attempt(s), 3 final run(s) whose rows "
            "stay in the JSONL ledger",
            "nothing deleted: pass --yes to delete",
        ])  # fmt: skip
        assert _left(run) == before

        # a planned point that goes back in flight before the delete (retried in place) is kept
        with get_client(sync_client=True) as client:
            plan = plan_prune(client, run, 2)
            _set_state(http, run, 6, "RUNNING")
            deleted = apply_prune(client, plan)
        assert sorted(d.step for d in plan.delete if d.flow_run_id in deleted) == [1, 2, 2]
        _set_state(http, run, 6, "COMPLETED")

    code, out = cli("prune", "--run", run, "--keep-last", "2", "--yes")
    assert (code, out.splitlines()[-1]) == (0, "deleted 1 flow run(s)")
    assert _left(run) == [(3, "COMPLETED"), (4, "COMPLETED"), (5, "RUNNING"), (7, "COMPLETED"), (8, "COMPLETED")]
    # the pruned steps are still listed, measured, from their ledger rows
    history = read_history(run)
    assert [(p.step, p.outcome, p.scores) for p in history.points if p.step in (1, 2, 6)] == [
        (1, "measured", {"arith": 0.01}), (2, "measured", {"arith": 0.02}), (6, "measured", {"arith": 0.06})
    ]  # fmt: skip
    assert cli("prune", "--run", run, "--keep-last", "2", "--yes")[1].splitlines()[-1] == "nothing to delete"


def test_prune_refuses_in_one_line_and_deletes_nothing(prefect_server: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    run, sinks, staging = f"prune-bad-{tag}", f"prune-nojsonl-{tag}", f"prune-best-{tag}"
    SinksBlock().save(sinks)  # no ledger: keep_best cannot rank
    StagingBlock(root=str(tmp_path / "staging"), keep_best=1, keep_best_metric="eval/arith").save(staging)
    with prefect_rest_client(prefect_server) as http:
        seed_points(http, run, range(1, 4), parameters={"sinks": sinks, "staging": staging})
    code, out = cli("prune", "--run", run, "--keep-last", "1", "--yes")
    assert (code, out.strip()) == (1, f"error: staging block {staging!r}: keep_best: ranks steps from the sinks "
                                      "block's jsonl_path, which is not set; cannot tell its best-kept steps; "
                                      "nothing deleted")  # fmt: skip
    assert len(_left(run)) == 3
    code, out = cli("prune", "--run", f"nobody-{tag}", "--keep-last", "1")
    assert (code, out.strip()) == (1, f"error: no eval point of run 'nobody-{tag}' is recorded")
    code, out = cli("prune", "--run", run, "--keep-last", "0")
    assert code == 2 and "--keep-last" in out and "Traceback" not in out
