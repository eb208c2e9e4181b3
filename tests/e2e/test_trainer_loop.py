"""EvalClient driven by a training-loop stub against the real server, worker and CPU fleet.

20 steps, eval every 4 (steps 3, 7, 11, 15, 19; 19 is final), in-loop export of the tiny model's
weights perturbed per step into staging, `skip` policy with at most 2 points in flight: every
eval step ends with exactly one record (measured, or skipped with its reason) and one flow run,
measured rows carry `eval/lag_steps`, and the final point is measured.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import pytest
from prefect.artifacts import Artifact

from pinned_eval.events import BlockNames
from pinned_eval.points import history_artifact_key, progress_variable_name
from pinned_eval.sinks import JsonlSink
from tests.deploykit import Deployed, runs_of_deployment
from tests.pointkit import CpuFleet, PointEnv, write_step_snapshot
from trainer_integration.client import DispatchResult, EvalClient
from trainer_integration.results import PointOutcome

pytestmark = pytest.mark.e2e

STEPS = 20
INTERVAL = 4


def perturbed_exporter(base: Path):  # type: ignore[no-untyped-def]
    def export(step: int, dest: str) -> None:
        write_step_snapshot(base, dest, scale=0.001 * (step + 1), seed=step)

    return export


def stall_summary(results: list[DispatchResult]) -> dict[str, float]:
    """Loop stall of the non-waiting dispatches, export excluded (admission + spool write)."""
    stalls = sorted(
        r.stall_seconds - (r.export_time_seconds or 0.0)
        for r in results
        if r.action in ("requested", "skipped_busy") and r.waited_seconds == 0
    )
    if not stalls:
        return {}
    return {
        "n": len(stalls),
        "p50_ms": 1000 * statistics.median(stalls),
        "p99_ms": 1000 * stalls[min(len(stalls) - 1, round(0.99 * (len(stalls) - 1)))],
    }


def test_training_loop_records_every_eval_step_once(
    point_env: PointEnv, deployed: Deployed, tiny_model: Path, tmp_path: Path
):
    client = EvalClient(
        point_env.run,
        deployed.api_url,
        blocks=BlockNames(**point_env.blocks),
        policy="skip",
        max_in_flight=2,
        staging_root=point_env.staging_root,
        exporter=perturbed_exporter(tiny_model),
        eval_interval=INTERVAL,
        spool_dir=tmp_path / "spool",
    )
    dispatched: list[DispatchResult] = []
    with client:
        for step in range(STEPS):
            time.sleep(0.3)  # "training"
            client.report_progress(step)
            result = client.dispatch(step, final=step == STEPS - 1)
            if result.action != "not_due":
                dispatched.append(result)
        client.flush_progress()
        outcomes = client.drain(timeout=240)
        rejected = client.spool.rejected()
        progress = client.rest.get_variable(progress_variable_name(point_env.run))

    eval_steps = [s for s in range(STEPS) if (s + 1) % INTERVAL == 0]
    assert [r.step for r in dispatched] == eval_steps
    assert not rejected
    assert not client.spool.pending()
    by_step = {o.step: o for o in outcomes}
    assert sorted(by_step) == eval_steps
    # exactly what the trainer decided: a requested point is measured, a busy one is skipped
    # `busy` at that step with both slots taken; nothing is in flight before the first two
    for r in dispatched:
        o = by_step[r.step]
        assert o.flow_runs == 1, (r, o)
        if r.action == "requested":
            assert (o.state, o.reason) == ("measured", None), (r, o)
        else:
            assert (r.action, r.in_flight, o.state, o.reason) == ("skipped_busy", 2, "skipped", "busy"), (r, o)
    assert [r.action for r in dispatched[:2]] == ["requested", "requested"]
    assert dispatched[-1].action == "requested"  # the final point is never skipped
    assert by_step[STEPS - 1].metrics  # per-dataset metrics read back from the JSONL sink

    runs = runs_of_deployment(deployed.deployment_id, point_env.run)
    assert sorted(r.name for r in runs) == sorted(f"{point_env.run}/step-{s}" for s in eval_steps)

    rows = JsonlSink(point_env.jsonl).read(point_env.run)
    for step in eval_steps:
        mine = [r for r in rows if r.step == step]
        states = {r.state for r in mine}
        assert len(states) == 1, (step, mine)  # one record: all datasets measured, or one skip row
        assert all("eval/lag_steps" in r.metrics for r in mine), mine
        if states == {"skipped"}:
            assert len(mine) == 1 and mine[0].metrics[f"eval/skipped_{mine[0].reason}"] == 1
        else:
            assert states == {"measured"} and {r.dataset for r in mine} == {"arith_add", "arith_sub"}
    # the run's history artifact, rebuilt from the JSONL by the last point, holds the trainer's skips too
    history = Artifact.get(history_artifact_key(point_env.run))
    assert history is not None
    table = json.loads(history.data) if isinstance(history.data, str) else history.data
    assert [(r["step"], r["state"], r["reason"] or None) for r in table] == [
        (s, by_step[s].state, by_step[s].reason) for s in eval_steps
    ]
    # exports that ran were timed and passed through; skipped-busy points exported nothing
    for r in dispatched:
        if r.action == "requested":
            assert r.export_time_seconds is not None and r.export_time_seconds > 0
        else:
            assert r.export_time_seconds is None
            assert not (point_env.staging_root / point_env.run / f"step_{r.step:08d}").exists()
    assert progress == STEPS - 1
    print("outcomes:", [(o.step, o.state, o.reason) for o in outcomes])
    print("dispatch stall:", stall_summary(dispatched))


def test_failed_in_loop_export_is_a_visible_skip_without_orphans(
    point_env: PointEnv, deployed: Deployed, tmp_path: Path
):
    def broken_export(step: int, dest: str) -> None:
        Path(dest).mkdir(parents=True)
        (Path(dest) / "model-00001.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    with EvalClient(
        point_env.run,
        deployed.api_url,
        blocks=BlockNames(**point_env.blocks),
        staging_root=point_env.staging_root,
        exporter=broken_export,
        spool_dir=tmp_path / "spool",
    ) as client:
        result = client.dispatch(5)
        [outcome] = client.drain(timeout=60)
    assert result.action == "skipped_export_failed"
    assert not (point_env.staging_root / point_env.run / "step_00000005").exists()
    assert outcome.state == "skipped" and outcome.reason == "export_failed", outcome
    assert "disk full" in (outcome.message or "")
    [fr] = runs_of_deployment(deployed.deployment_id, point_env.run)
    assert fr.name == f"{point_env.run}/step-5" and fr.state.name == "Skipped"
    assert {f"run:{point_env.run}", "step:5"} <= set(fr.tags)
    [row] = JsonlSink(point_env.jsonl).read(point_env.run)
    assert row.state == "skipped" and row.metrics["eval/skipped_export_failed"] == 1


def test_evaluate_now_closes_the_producer_gate_for_a_shared_point(
    point_env: PointEnv, deployed: Deployed, tiny_model: Path, cpu_fleet: CpuFleet, tmp_path: Path
):
    from pinned_eval.fleet import FleetClient, FleetConfig
    from trainer_integration.gate import ProducerGate

    # the live engines last received the weights of step 7 (a weight update, as training does)
    weights = write_step_snapshot(tiny_model, str(tmp_path / "update-7"), scale=0.001, seed=7)

    async def update_engines() -> None:
        config = FleetConfig(api_key=cpu_fleet.api_key, admin_api_key=cpu_fleet.admin_api_key)
        async with FleetClient(cpu_fleet.engine_urls, cpu_fleet.router_url, config=config) as fleet:
            await fleet.pin(weights, "7")

    asyncio.run(update_engines())
    gate = ProducerGate()
    open_while_evaluating: list[bool] = []

    async def loop_step() -> PointOutcome:
        with EvalClient(
            point_env.run, deployed.api_url, blocks=BlockNames(**point_env.blocks), spool_dir=tmp_path / "spool"
        ) as client:
            point = asyncio.create_task(client.evaluate_now(7, gate, timeout=180))
            await asyncio.sleep(0)  # let the point start (it closes the gate first)
            while not point.done():
                open_while_evaluating.append(gate.is_open)
                await asyncio.sleep(0.2)
            return await point

    outcome = asyncio.run(loop_step())
    assert outcome.state == "measured", outcome
    assert open_while_evaluating and not any(open_while_evaluating)  # paused for the whole point
    assert gate.is_open and gate.times_closed == 1  # and reopened after it
    [fr] = runs_of_deployment(deployed.deployment_id, point_env.run)
    assert fr.parameters["posture"] == "shared" and fr.parameters["source"] is None
    rows = JsonlSink(point_env.jsonl).read(point_env.run)
    assert {r.weight_version for r in rows} == {"7"} and {r.state for r in rows} == {"measured"}
