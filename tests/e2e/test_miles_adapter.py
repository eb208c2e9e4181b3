"""The miles adapter against a real Prefect server: a fake miles input object in, miles-shaped
results or miles-style skips out. Points run through the deployed eval-point (process worker),
and through a flow run that uses the external task, so the REST read-back is exercised on both."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prefect import flow

from blocks import ExternalBackendBlock, FleetBlock, SinksBlock
from pinned_eval.settings import PrefectApiSettings
from tasks.external import evaluate_external
from tasks.log import log_point, measured_rows
from tests.conftest import free_port
from tests.deploykit import Deployed, runs_of_deployment
from tests.pointkit import SMALL_SUITE, PointEnv, save_point_blocks, write_step_snapshot
from trainer_integration.miles_adapter import (
    AdapterConfig,
    MilesEvalSkip,
    PinnedEvalFn,
    PinnedEvalREST,
    SamplesNotRecorded,
    collect_point,
)

pytestmark = pytest.mark.e2e
BACKEND = "trainer_integration.sglang_backend:SGLangCheckpointEval"


def miles_fn(env: PointEnv, api_url: str, **extra: object) -> PinnedEvalFn:
    """What miles builds from `--eval-function-path`: the class called with RolloutFnConstructorInput."""
    args = SimpleNamespace(
        pinned_eval_api_url=api_url,
        pinned_eval_run=env.run,
        pinned_eval_blocks=env.blocks,
        pinned_eval_poll_interval_s=0.5,
        pinned_eval_timeout_s=240.0,
        **{f"pinned_eval_{k}": v for k, v in extra.items()},
    )
    return PinnedEvalFn(SimpleNamespace(args=args, data_source=None))


def eval_input(step: int, hf_dir: str) -> SimpleNamespace:
    """miles' RolloutFnEvalInput as the snapshot posture fills it."""
    return SimpleNamespace(rollout_id=step, evaluation=True, hf_dir=hf_dir, weight_version=str(step))


@pytest.fixture
def dead_fleet_env(prefect_server: str, tmp_path: Path) -> PointEnv:
    """Blocks whose fleet is never reached (points that skip before the pin)."""
    dead = [f"http://127.0.0.1:{free_port()}"]
    fleet = FleetBlock(name=f"d{uuid.uuid4().hex[:6]}", mode="attach", engine_urls=dead, router_url=dead[0])
    return save_point_blocks(tmp_path, fleet)


def test_skipped_point_raises_miles_style_skip_once_per_step(
    dead_fleet_env: PointEnv, deployed: Deployed, tiny_model: Path, tmp_path: Path
) -> None:
    hf_dir = write_step_snapshot(tiny_model, str(tmp_path / "step_4"))
    (Path(hf_dir) / ".complete").unlink()  # miles' export died before the marker
    fn = miles_fn(dead_fleet_env, deployed.api_url)
    for _ in range(2):  # a retried call is the same point
        with pytest.raises(MilesEvalSkip) as info:
            asyncio.run(fn(eval_input(4, hf_dir)))
        assert info.value.reason == "ckpt_missing"
    [fr] = runs_of_deployment(deployed.deployment_id, dead_fleet_env.run)
    assert fr.name == f"{dead_fleet_env.run}/step-4"
    assert fr.parameters["source"] == {"kind": "hf", "path": hf_dir, "hf_base": None, "require_marker": True}
    assert Path(hf_dir).exists(), "pinned-eval never deletes miles' snapshot"
    fn.dispose()


@flow(name="external-point-probe")
def external_point(run: str, step: int, checkpoint_dir: str, options: dict, jsonl: str) -> dict:
    """An external-posture point reduced to its two recording steps: the backend, then the sinks."""
    per_dataset = evaluate_external(BACKEND, checkpoint_dir, run, step, SMALL_SUITE, options)
    point = {"eval/step": step, "eval/lag_steps": 0, "eval/duration_seconds": 1.0}
    log_point(run, step, measured_rows(run, step, per_dataset, point), SinksBlock(jsonl_path=jsonl))
    return per_dataset


def test_measured_point_reads_back_miles_shaped_results(prefect_server: str, tiny_model: Path, tmp_path: Path) -> None:
    run, step = f"m{uuid.uuid4().hex[:8]}", 6
    snap = write_step_snapshot(tiny_model, str(tmp_path / "step_6"))
    options = {"launch": "cpu", "model_path": str(tiny_model), "log_dir": str(tmp_path / "logs")}
    state = external_point(run, step, snap, options, str(tmp_path / "m.jsonl"), return_state=True)
    assert state.is_completed(), state.message
    per_dataset = state.result()
    out = asyncio.run(_collect(prefect_server, run, str(state.state_details.flow_run_id), step))
    assert set(out.data) == {"arith_add", "arith_sub"}
    for ds, d in out.data.items():
        assert len(d["rewards"]) == len(d["truncated"]) == 6
        assert set(d["weight_versions"]) == {str(step)}
        assert [(x.index, x.reward, x.weight_versions) for x in d["samples"]] == [
            (i, r, [str(step)]) for i, r in enumerate(d["rewards"])
        ]  # miles' samples key (--save-debug-rollout-data)
        assert sum(d["rewards"]) / 6 == pytest.approx(per_dataset[ds][f"eval/{ds}"])
        assert out.metrics[f"eval/{ds}/weight_version/mean"] == step
        assert out.metrics[f"eval/{ds}/weight_version/mixed_version_ratio"] == 0
    assert "eval/step" not in out.metrics and "eval/lag_steps" not in out.metrics  # miles logs its own


def test_measured_point_without_samples_is_refused(prefect_server: str, tmp_path: Path) -> None:
    @flow(name="no-samples-probe")
    def no_samples() -> None:
        return None

    state = no_samples(return_state=True)
    with pytest.raises(SamplesNotRecorded, match="published no per-sample results"):
        asyncio.run(_collect(prefect_server, "nosamples", str(state.state_details.flow_run_id), 1))


async def _collect(api_url: str, run: str, flow_run_id: str, step: int):  # type: ignore[no-untyped-def]
    auth = PrefectApiSettings().api_auth_string  # the test server's credential, from the environment
    config = AdapterConfig(api_url=api_url, run=run, poll_interval_s=0.2, timeout_s=30, auth_string=auth)
    async with httpx.AsyncClient(timeout=30) as http:
        rest = PinnedEvalREST(config, http)
        return await collect_point(rest, await rest.wait(flow_run_id), step)


def test_deployed_external_point_returns_miles_shaped_results(
    dead_fleet_env: PointEnv, deployed: Deployed, tiny_model: Path, tmp_path: Path
) -> None:
    hf_dir = write_step_snapshot(tiny_model, str(tmp_path / "step_16"))
    options = {"launch": "cpu", "model_path": str(tiny_model), "log_dir": str(tmp_path / "logs")}
    block = f"miles-{uuid.uuid4().hex[:8]}"  # the operator's saved backend; the adapter names it
    ExternalBackendBlock(backend=BACKEND, options=options).save(block)
    fn = miles_fn(dead_fleet_env, deployed.api_url, posture="external", backend_block=block)
    out = asyncio.run(fn(eval_input(16, hf_dir)))
    assert set(out.data) == {"arith_add", "arith_sub"}
    for ds, d in out.data.items():
        assert len(d["rewards"]) == len(d["truncated"]) == 6 and set(d["weight_versions"]) == {"16"}
        assert out.metrics[f"eval/{ds}/weight_version/mean"] == 16
