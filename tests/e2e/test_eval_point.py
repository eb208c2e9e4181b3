"""The eval-point flow end to end: real Prefect server, CPU fleet behind sglang-router, real snapshots."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from prefect import get_client
from prefect.artifacts import Artifact
from prefect.variables import Variable

from blocks import EvalSuiteBlock, FleetBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.points import history_artifact_key, inflight_limit_name, progress_variable_name
from pinned_eval.sinks import JsonlSink
from pinned_eval.snapshot.layout import RETIRED
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults
from tasks.admission import admitted
from tests.conftest import free_port
from tests.faults import RelabelingProxy
from tests.pointkit import SLOW_SUITE, SMALL_SUITE, PointEnv, save_point_blocks, write_step_snapshot
from tests.slots import SlotHolder, refusals
from tests.wandb_offline import history_rows, metric_definitions, runs

pytestmark = pytest.mark.e2e


def run_point(env: PointEnv, step: int, **params: object):
    state = eval_point(**env.params(step, **params), return_state=True)
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(state.state_details.flow_run_id)
    return state, fr


def staged(env: PointEnv, step: int, tiny: Path, **kw: object) -> dict[str, str]:
    store = StagingBlock.load(env.blocks["staging"]).staging()
    dest = store.path_for(env.run, step)
    write_step_snapshot(tiny, dest, **kw)  # type: ignore[arg-type]
    return {"kind": "staged", "path": dest}


def test_measured_point_pins_exactly_its_step(prefect_server: str, cpu_fleet, tmp_path: Path, tiny_model: Path) -> None:
    fleet = FleetBlock(name="measured", mode="launch", state_file=str(cpu_fleet.state_file))
    point_env = save_point_blocks(tmp_path, fleet, wandb=True)
    Variable.set(progress_variable_name(point_env.run), 10, overwrite=True)  # the trainer is at step 10
    state, fr = run_point(point_env, 7, source=staged(point_env, 7, tiny_model))
    assert state.is_completed() and state.name == "Completed", state.message
    assert fr.name == f"{point_env.run}/step-7"
    assert {f"run:{point_env.run}", "step:7"} <= set(fr.tags)
    rows = JsonlSink(point_env.jsonl).read(point_env.run)
    assert {r.dataset for r in rows} == {"arith_add", "arith_sub"}
    for r in rows:
        ds = r.dataset
        assert r.state == "measured" and r.step == 7 and r.weight_version == "7"
        assert r.metrics[f"eval/{ds}/weight_version/mean"] == 7
        assert r.metrics[f"eval/{ds}/weight_version/mixed_version_ratio"] == 0
        assert r.metrics["eval/step"] == 7
        assert r.metrics["eval/lag_steps"] == 3
    history = Artifact.get(history_artifact_key(point_env.run))
    assert history is not None
    table = json.loads(history.data) if isinstance(history.data, str) else history.data
    assert [(row["step"], row["state"], row["weight_version"]) for row in table] == [(7, "measured", "7")]
    for r in rows:
        assert table[0][f"eval/{r.dataset}"] == pytest.approx(r.metrics[f"eval/{r.dataset}"], abs=1e-4)
    [wandb_row] = history_rows(tmp_path)  # the point's metrics, logged once at eval/step 7
    assert wandb_row == pytest.approx({k: v for r in rows for k, v in r.metrics.items()})


def test_fleet_point_logs_pass_at_k_and_its_duration(
    prefect_server: str, cpu_fleet, tmp_path: Path, tiny_model: Path
) -> None:
    """pass@k and `eval/duration_seconds` read back from a real fleet point's JSONL row. Greedy
    decoding makes the 4 samples of a prompt identical, so every pass@k equals the mean reward."""
    suite = EvalSuite(
        datasets=(DatasetSpec(name="arith_add", path="builtin:arith_add.jsonl", max_prompts=4),),
        defaults=SamplingDefaults(temperature=0.0, max_new_tokens=3, n_samples_per_prompt=4, reward="exact_match"),
        pass_at_k=True,
    )
    fleet = FleetBlock(name="passk", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, suite=suite, keep_snapshots=0)
    before = time.monotonic()
    state, _ = run_point(env, 8, source=staged(env, 8, tiny_model))
    wall = time.monotonic() - before
    assert state.name == "Completed", state.message
    [row] = JsonlSink(env.jsonl).read(env.run)
    passk = {k: v for k, v in row.metrics.items() if "-pass@" in k}
    assert sorted(passk) == ["eval/arith_add-pass@1", "eval/arith_add-pass@2", "eval/arith_add-pass@4"]
    assert set(passk.values()) == {row.metrics["eval/arith_add"]}
    assert 0 < row.metrics["eval/duration_seconds"] < wall


def test_busy_under_skip_policy_is_a_skipped_point(point_env: PointEnv) -> None:
    with admitted(point_env.run, 1, policy="skip", final=False, max_in_flight=1):
        state, _ = run_point(
            point_env, 2, source={"kind": "hf", "path": str(point_env.staging_root / "nonexistent")}, policy="skip",
            max_in_flight=1,
        )
    assert state.is_completed() and state.name == "Skipped"
    assert state.message.startswith("busy")
    [row] = JsonlSink(point_env.jsonl).read(point_env.run)
    assert row.metrics == {"eval/step": 2, "eval/skipped_busy": 1, "eval/lag_steps": 0}


def test_final_point_waits_instead_of_skipping(point_env: PointEnv, tiny_model: Path) -> None:
    """The slot is released only after the final point was refused one: it waited, then measured."""
    source = staged(point_env, 5, tiny_model)
    order: list[str] = []
    with SlotHolder(point_env.run, 4, order) as holder, refusals(order, "final refused") as refused:
        holder.release_when(refused)
        state, _ = run_point(point_env, 5, source=source, policy="skip", max_in_flight=1, final=True)
        order.append(f"final {state.name}")
    assert order == ["held", "final refused", "releasing", "final Completed"], state.message
    rows = JsonlSink(point_env.jsonl).read(point_env.run)
    assert [(r.step, r.state) for r in rows] == [(5, "measured")] * len(SMALL_SUITE.datasets)


def test_backpressure_waits_then_measures(point_env: PointEnv, tiny_model: Path) -> None:
    """Under backpressure a full limit is waited for (refused while held, admitted after the
    release), and `eval/duration_seconds` counts the wait (miles: queued time counts)."""
    source = staged(point_env, 6, tiny_model)
    order: list[str] = []
    with SlotHolder(point_env.run, 0, order) as holder, refusals(order, "point refused") as refused:
        holder.release_when(refused)
        state, _ = run_point(point_env, 6, source=source, policy="backpressure", max_in_flight=1)
        order.append(f"point {state.name}")
    assert order == ["held", "point refused", "releasing", "point Completed"], state.message
    rows = JsonlSink(point_env.jsonl).read(point_env.run)
    assert [(r.step, r.state) for r in rows] == [(6, "measured")] * len(SMALL_SUITE.datasets)
    # the point started before its refusal and ended after the release: its duration spans both
    assert refused.at is not None and holder.released_at is not None
    assert rows[0].metrics["eval/duration_seconds"] > holder.released_at - refused.at


def test_missing_marker_and_truncated_shard_are_ckpt_missing(
    prefect_server: str, cpu_fleet, tmp_path: Path, tiny_model: Path
) -> None:
    fleet = FleetBlock(name="ckpt", mode="launch", state_file=str(cpu_fleet.state_file))
    point_env = save_point_blocks(tmp_path, fleet, keep_snapshots=0)
    src = staged(point_env, 3, tiny_model)
    (Path(src["path"]) / ".complete").unlink()
    state, _ = run_point(point_env, 3, source=src)
    assert state.name == "Skipped" and state.message.startswith("ckpt_missing")
    assert "missing_marker" in state.message
    assert not Path(src["path"]).exists(), "a ckpt_missing point still retires its owned snapshot"

    src = staged(point_env, 4, tiny_model)
    shard = sorted(Path(src["path"]).glob("model-*.safetensors"))[0]
    os.truncate(shard, shard.stat().st_size - 1)
    state, _ = run_point(point_env, 4, source=src)
    assert state.name == "Skipped" and "truncated_shard" in state.message
    assert not Path(src["path"]).exists()
    reasons = {r.step: r.reason for r in JsonlSink(point_env.jsonl).read(point_env.run)}
    assert reasons == {3: "ckpt_missing", 4: "ckpt_missing"}


def test_engines_down_in_attach_mode_is_unhealthy(
    prefect_server: str, tmp_path: Path, tiny_model: Path
) -> None:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    fleet = FleetBlock(name="dead", mode="attach", engine_urls=dead, router_url=f"http://127.0.0.1:{free_port()}")
    env = save_point_blocks(tmp_path, fleet, keep_snapshots=0)
    src = staged(env, 9, tiny_model)
    state, _ = run_point(env, 9, source=src)
    assert state.name == "Skipped" and state.message.startswith("unhealthy"), state.message
    assert not Path(src["path"]).exists(), "an unhealthy point still retires its owned snapshot"
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert row.metrics["eval/skipped_unhealthy"] == 1 and row.step == 9


def test_reward_that_raises_fails_the_run_and_records_crashed(
    prefect_server: str, cpu_fleet, tmp_path: Path, tiny_model: Path
) -> None:
    suite = SMALL_SUITE.model_copy(
        update={"defaults": SMALL_SUITE.defaults.model_copy(update={"reward": "custom:tests.rewards:explode"})}
    )
    fleet = FleetBlock(name="crash", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, suite=suite, keep_snapshots=0)
    src = staged(env, 11, tiny_model)
    state, _ = run_point(env, 11, source=src)
    assert state.is_failed()
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert row.state == "failed" and row.metrics["eval/skipped_crashed"] == 1
    assert not Path(src["path"]).exists(), "a crashed point still retires its snapshot"


def test_keep_ring_of_two_after_three_points_and_hf_survives(point_env: PointEnv, tiny_model: Path) -> None:
    paths = []
    for step in (1, 2, 3):
        src = staged(point_env, step, tiny_model)
        paths.append(Path(src["path"]))
        state, _ = run_point(point_env, step, source=src)
        assert state.name == "Completed", state.message
    assert [p.exists() for p in paths] == [False, True, True]


def test_hf_source_survives_keep_zero(prefect_server: str, cpu_fleet, tmp_path: Path, tiny_model: Path) -> None:
    fleet = FleetBlock(name="hfkeep", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, keep_snapshots=0)
    hf_dir = tmp_path / "hf-step-12"
    write_step_snapshot(tiny_model, str(hf_dir))
    state, _ = run_point(env, 12, source={"kind": "hf", "path": str(hf_dir)})
    assert state.name == "Completed", state.message
    assert (hf_dir / ".complete").exists()


def test_failed_export_leaves_nothing_behind(point_env: PointEnv, tmp_path: Path, tiny_model: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    state, _ = run_point(point_env, 13, source={"kind": "state_dict", "path": str(bad), "hf_base": str(tiny_model)})
    assert state.name == "Skipped" and state.message.startswith("export_failed"), state.message
    store = StagingBlock.load(point_env.blocks["staging"]).staging()
    assert not Path(store.path_for(point_env.run, 13)).exists()


def test_engine_reporting_another_version_is_pin_violation(
    prefect_server: str, cpu_fleet, tmp_path: Path, tiny_model: Path
) -> None:
    liar, honest = cpu_fleet.engine_urls
    proxy = RelabelingProxy(liar, "999")
    try:
        fleet = FleetBlock(name="liar", mode="attach", engine_urls=[proxy.url, honest], router_url=cpu_fleet.router_url,
                           **cpu_fleet.block_keys())
        env = save_point_blocks(tmp_path, fleet, keep_snapshots=0)
        src = staged(env, 14, tiny_model)
        state, _ = run_point(env, 14, source=src)
    finally:
        proxy.close()
    assert state.name == "Skipped" and state.message.startswith("pin_violation"), state.message
    assert not Path(src["path"]).exists(), "a pin_violation point still retires its owned snapshot"
    assert proxy.loads == 2, "two attempts, then the skip"
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert row.metrics["eval/skipped_pin_violation"] == 1


def test_setup_failure_is_recorded_and_retires_the_owned_snapshot(
    prefect_server: str, tmp_path: Path, tiny_model: Path
) -> None:
    """A block that fails to load (here: no such fleet) fails the point after its setup started:
    `skipped_crashed` is recorded at the step and the staged snapshot it owns is still retired."""
    dead = [f"http://127.0.0.1:{free_port()}"]
    env = save_point_blocks(tmp_path, FleetBlock(name="setupfail", mode="attach", engine_urls=dead, router_url=dead[0]))
    source = staged(env, 8, tiny_model)
    state = eval_point(**env.params(8, source=source, fleet="no-such-fleet"), return_state=True)
    assert state.is_failed(), state
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert row.step == 8 and row.state == "failed" and row.metrics["eval/skipped_crashed"] == 1
    assert (Path(source["path"]) / RETIRED).exists(), "the owned snapshot entered the keep-ring"


def test_bad_parameters_are_refused_naming_the_field_before_anything_runs(prefect_server: str, tmp_path: Path) -> None:
    dead = [f"http://127.0.0.1:{free_port()}"]
    env = save_point_blocks(tmp_path, FleetBlock(name="badparams", mode="attach", engine_urls=dead, router_url=dead[0]))
    state = eval_point(**env.params(3, source={"kind": "hf", "path": "/x"}, posture="external"), return_state=True)
    assert state.is_failed() and "backend" in str(state.message), state.message
    assert not env.jsonl.exists() or JsonlSink(env.jsonl).read(env.run) == []


def test_point_past_its_deadline_is_timed_out_and_frees_lock_slot_and_snapshot(
    prefect_server: str, cpu_fleet, tmp_path: Path, tiny_model: Path
) -> None:
    fleet = FleetBlock(name="deadline", mode="launch", state_file=str(cpu_fleet.state_file))
    # SLOW_SUITE scores for ~12 s; the deadline ends the point well before that
    env = save_point_blocks(tmp_path, fleet, suite=SLOW_SUITE, keep_snapshots=0, point_timeout_seconds=6)
    src = staged(env, 21, tiny_model)
    state, _ = run_point(env, 21, source=src, max_in_flight=1)
    assert state.is_completed() and state.name == "Skipped", state.message
    assert state.message.startswith("timed_out: step 21"), state.message
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert (row.step, row.state, row.reason) == (21, "skipped", "timed_out")
    assert row.metrics["eval/skipped_timed_out"] == 1 and row.metrics["eval/step"] == 21
    history = Artifact.get(history_artifact_key(env.run))
    assert history is not None
    table = json.loads(history.data) if isinstance(history.data, str) else history.data
    assert [(r["step"], r["state"], r["reason"]) for r in table] == [(21, "skipped", "timed_out")]
    assert not Path(src["path"]).exists(), "a timed-out point retires its owned snapshot"
    with get_client(sync_client=True) as c:
        for name in (FleetBlock.load(env.blocks["fleet"]).lock_name, inflight_limit_name(env.run)):
            assert c.read_global_concurrency_limit_by_name(name).active_slots == 0, name
    # the fleet serves the run's next point (a fast suite) at once
    EvalSuiteBlock(suite=SMALL_SUITE).save(fast := f"{env.blocks['suite']}-fast")
    state, _ = run_point(env, 22, source=staged(env, 22, tiny_model), max_in_flight=1, suite=fast)
    assert state.name == "Completed", state.message
    assert [r.step for r in JsonlSink(env.jsonl).read(env.run) if r.state == "measured"] == [22, 22]


def test_wandb_rows_go_to_an_eval_run_grouped_with_the_training_run(
    prefect_server: str, cpu_fleet, tmp_path: Path, tiny_model: Path
) -> None:
    from blocks import SinksBlock

    fleet = FleetBlock(name="wandb", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, wandb=True)
    sinks = SinksBlock.load(env.blocks["sinks"]).model_copy(update={"wandb_run_id": f"train-{env.run}"})
    sinks.save(env.blocks["sinks"], overwrite=True)  # the live training run the rows go beside
    state, _ = run_point(env, 5, source=staged(env, 5, tiny_model))
    assert state.name == "Completed", state.message
    src = staged(env, 6, tiny_model)
    (Path(src["path"]) / ".complete").unlink()
    state, _ = run_point(env, 6, source=src)
    assert state.name == "Skipped", state.message

    # one dedicated eval run, resumed by the second point; the training run is never opened
    assert {tuple(r.values()) for r in runs(tmp_path)} == {(f"train-{env.run}-eval", f"train-{env.run}", "eval")}
    assert ("eval/*", "eval/step") in metric_definitions(tmp_path)
    rows = history_rows(tmp_path)
    assert [r["eval/step"] for r in rows] == [5, 6]
    assert rows[0]["eval/arith_add/weight_version/mean"] == 5 and rows[1]["eval/skipped_ckpt_missing"] == 1
    with get_client(sync_client=True) as c:
        lock = c.read_global_concurrency_limit_by_name(f"wandb-train-{env.run}-eval")
    assert (lock.limit, lock.active_slots) == (1, 0)
