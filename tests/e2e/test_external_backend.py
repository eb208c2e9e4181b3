"""The reference external backend against real CPU engines (one it launches, one it attaches to),
and the `evaluate_external` task inside real Prefect flow runs."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from prefect import flow, get_client
from prefect.states import Completed

from pinned_eval.external import (
    CheckpointEvalFn,
    DatasetResult,
    EvalInput,
    EvalResults,
    EvalSkip,
    results_from_rows,
    results_to_metrics,
    samples_artifact_key,
)
from pinned_eval.fleet.cpu_engine import EngineProcess
from pinned_eval.processes import is_running
from pinned_eval.skips import EvalSkipped, skip_metric
from tasks.external import BACKENDS, evaluate_external
from tests.e2e.conftest import EngineStarter
from tests.pointkit import SMALL_SUITE, write_step_snapshot
from trainer_integration.sglang_backend import SGLangCheckpointEval

pytestmark = pytest.mark.e2e
N_SAMPLES = sum(min(d.max_prompts or 10**6, 50) for d in SMALL_SUITE.datasets)  # 6 + 6 prompts, n = 1


@pytest.fixture(scope="module")
def attached_engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    starter = EngineStarter(tmp_path_factory.mktemp("attached"))
    try:
        yield starter(tiny_model)
    finally:
        starter.stop_all()


def _snapshot(tiny: Path, root: Path, step: int) -> str:
    return write_step_snapshot(tiny, str(root / f"step_{step}"))


def _model_info(url: str, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{url}/model_info", headers=headers, timeout=10).json()


async def test_launched_cpu_server_waits_pins_then_evals(tiny_model: Path, tmp_path: Path) -> None:
    snap = _snapshot(tiny_model, tmp_path, 5)
    backend = SGLangCheckpointEval(launch="cpu", model_path=str(tiny_model), log_dir=str(tmp_path / "logs"),
                                   api_key="ext-data-key", admin_api_key="ext-admin-key")
    launched = backend.launched
    assert launched is not None and is_running(launched)
    try:
        inp = EvalInput(run="exp42", step=5, hf_dir=snap, suite=SMALL_SUITE)
        results = await backend.evaluate_checkpoint(snap, inp)
        info = _model_info(backend.url, "ext-data-key")
        assert (info["weight_version"], info["model_path"]) == ("5", snap)
    finally:
        backend.dispose()
    assert not is_running(launched), "dispose stops the server it launched"
    backend.dispose()  # idempotent
    [pin] = backend.history.pins
    assert pin.load_ok and pin.weight_version == "5" and not pin.problem
    assert backend.history.generated == N_SAMPLES
    assert {ds: len(r) for ds, r in results.data.items()} == {"arith_add": 6, "arith_sub": 6}
    assert all(v == "5" for r in results.data.values() for v in r.weight_versions)
    metrics = results_to_metrics(results, inp)
    for ds, m in metrics.items():
        assert m[f"eval/{ds}/weight_version/mean"] == 5
        assert m[f"eval/{ds}/weight_version/mixed_version_ratio"] == 0
        assert m[f"eval/{ds}"] == sum(r or 0 for r in results.data[ds].rewards) / 6


async def test_attached_server_is_pinned_and_survives_dispose(
    attached_engine: EngineProcess, tiny_model: Path, tmp_path: Path
) -> None:
    snap = _snapshot(tiny_model, tmp_path, 8)
    backend = SGLangCheckpointEval(url=attached_engine.url)
    assert backend.launched is None
    results = await backend.evaluate_checkpoint(snap, EvalInput(run="exp42", step=8, hf_dir=snap, suite=SMALL_SUITE))
    backend.dispose()
    assert attached_engine.proc.poll() is None, "dispose never stops an attached server"
    assert httpx.get(f"{attached_engine.url}/health_generate", timeout=30).status_code == 200
    assert _model_info(attached_engine.url)["weight_version"] == "8"
    assert {v for r in results.data.values() for v in r.weight_versions} == {"8"}


async def test_pin_failure_retries_then_skips(attached_engine: EngineProcess, tiny_model: Path, tmp_path: Path) -> None:
    broken = Path(_snapshot(tiny_model, tmp_path, 9))
    for shard in broken.glob("model-*.safetensors"):
        shard.write_bytes(b"not safetensors")
    backend = SGLangCheckpointEval(url=attached_engine.url)
    inp = EvalInput(run="exp42", step=9, hf_dir=str(broken), suite=SMALL_SUITE)
    with pytest.raises(EvalSkip) as info:
        await backend.evaluate_checkpoint(str(broken), inp)
    assert info.value.reason == "pin_violation" and "not verified after 2 attempts" in info.value.message
    assert [p.attempt for p in backend.history.pins] == [1, 2]
    assert not any(p.load_ok for p in backend.history.pins)
    assert backend.history.generated == 0, "no eval after a failed pin"


async def test_unreachable_attached_server_is_unhealthy(tmp_path: Path) -> None:
    from tests.conftest import free_port

    backend = SGLangCheckpointEval(url=f"http://127.0.0.1:{free_port()}", ready_timeout_s=1.0)
    with pytest.raises(EvalSkip) as info:
        await backend.evaluate_checkpoint("/nowhere", EvalInput(run="exp42", step=1, hf_dir="/x", suite=SMALL_SUITE))
    assert info.value.reason == "unhealthy"


# ---------------------------------------------------------------------------- inside Prefect


class QuotaBackend(CheckpointEvalFn):
    """A backend whose service refuses: an attributable `quota` skip."""

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:
        raise EvalSkip("quota", f"no credits for {input.run}/{input.weight_version}")


@flow(name="external-task-probe")
def external_probe(backend: str, checkpoint_dir: str, run: str, step: int, options: dict | None = None):
    try:
        return evaluate_external(backend, checkpoint_dir, run, step, SMALL_SUITE, options)
    except EvalSkipped as skip:  # what eval_point does with it
        return Completed(name="Skipped", message=f"{skip.reason}: {skip.message}")


def test_task_in_a_flow_run_measures_and_publishes_samples(
    prefect_server: str, tiny_model: Path, tmp_path: Path
) -> None:
    snap = _snapshot(tiny_model, tmp_path, 12)
    options = {"launch": "cpu", "model_path": str(tiny_model), "log_dir": str(tmp_path / "logs")}
    path = "trainer_integration.sglang_backend:SGLangCheckpointEval"
    try:
        state = external_probe(path, snap, "ext-run", 12, options, return_state=True)
    finally:
        BACKENDS.drop(path, options)  # stops the server it launched (else: at interpreter exit)
    assert state.is_completed() and state.name == "Completed", state.message
    metrics = state.result()
    assert {ds: m[f"eval/{ds}/weight_version/mean"] for ds, m in metrics.items()} == {"arith_add": 12, "arith_sub": 12}
    with get_client(sync_client=True) as c:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

        [art] = c.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[samples_artifact_key("ext-run", 12)]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]),
            )
        )
    rows = json.loads(art.data) if isinstance(art.data, str) else art.data
    data = results_from_rows(rows)
    assert {ds: set(r.weight_versions) for ds, r in data.items()} == {"arith_add": {"12"}, "arith_sub": {"12"}}


def test_backend_quota_skip_is_skipped_quota(prefect_server: str) -> None:
    state = external_probe(f"{__name__}:QuotaBackend", "/snap/step_3", "ext-run", 3, return_state=True)
    assert state.is_completed() and state.name == "Skipped"
    assert state.message.startswith("quota: no credits for ext-run/3")
    assert skip_metric(state.message.split(":", 1)[0]) == "eval/skipped_quota"


# ---------------------------------------------------------------------------- the eval-point flow, posture external



def _external_env(tmp_path: Path):  # type: ignore[no-untyped-def]
    from blocks import FleetBlock
    from tests.conftest import free_port
    from tests.pointkit import save_point_blocks

    dead = [f"http://127.0.0.1:{free_port()}"]  # the external posture never touches the fleet
    return save_point_blocks(tmp_path, FleetBlock(name="ext", mode="attach", engine_urls=dead, router_url=dead[0]))


def _backend_block(path: str, options: dict | None = None) -> str:
    """Save the backend as an operator would (an ExternalBackendBlock); points name the block."""
    import uuid

    from blocks import ExternalBackendBlock

    name = f"ext-{uuid.uuid4().hex[:8]}"
    ExternalBackendBlock(backend=path, options=options or {}).save(name)
    return name



def test_eval_point_external_posture_measures_its_step(prefect_server: str, tiny_model: Path, tmp_path: Path) -> None:
    from flows.eval_point import eval_point
    from pinned_eval.sinks import JsonlSink

    env = _external_env(tmp_path)
    snap = _snapshot(tiny_model, tmp_path, 14)
    options = {"launch": "cpu", "model_path": str(tiny_model), "log_dir": str(tmp_path / "logs")}
    path = "trainer_integration.sglang_backend:SGLangCheckpointEval"
    try:
        state = eval_point(
            **env.params(14, source={"kind": "hf", "path": snap}, posture="external"),
            backend_block=_backend_block(path, options),
            return_state=True,
        )
    finally:
        BACKENDS.drop(path, options)
    assert state.is_completed() and state.name == "Completed", state.message
    rows = JsonlSink(env.jsonl).read(env.run)
    assert {r.dataset for r in rows} == {"arith_add", "arith_sub"}
    for r in rows:
        assert r.state == "measured" and r.weight_version == "14"
        assert r.metrics[f"eval/{r.dataset}/weight_version/mean"] == 14
        assert r.metrics[f"eval/{r.dataset}/weight_version/mixed_version_ratio"] == 0



def test_eval_point_external_quota_is_skipped_quota(prefect_server: str, tiny_model: Path, tmp_path: Path) -> None:
    from flows.eval_point import eval_point
    from pinned_eval.sinks import JsonlSink

    env = _external_env(tmp_path)
    snap = _snapshot(tiny_model, tmp_path, 15)
    state = eval_point(
        **env.params(15, source={"kind": "hf", "path": snap}, posture="external"),
        backend_block=_backend_block(f"{__name__}:QuotaBackend"),
        return_state=True,
    )
    assert state.is_completed() and state.name == "Skipped" and state.message.startswith("quota"), state.message
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert row.state == "skipped" and row.reason == "quota"
    assert row.metrics["eval/skipped_quota"] == 1 and row.metrics["eval/step"] == 15


class SerialProbe(CheckpointEvalFn):
    """Records its construction and every eval's begin/end (the pin and the eval of one version)."""

    events: ClassVar[list[tuple[str, str]]] = []
    # set by the test: an eval holds the backend lock until the other point was refused it
    other_waiting: ClassVar[threading.Event | None] = None

    def __init__(self, tag: str) -> None:
        SerialProbe.events.append(("init", tag))

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:
        import asyncio

        v = input.weight_version
        SerialProbe.events.append(("pin", v))
        if SerialProbe.other_waiting is not None:  # a second point interleaving here would re-pin this one
            await asyncio.to_thread(SerialProbe.other_waiting.wait, 120)
        else:
            await asyncio.sleep(1.5)
        SerialProbe.events.append(("evaluated", v))
        return EvalResults(
            data={
                ds.name: DatasetResult(rewards=[1.0] * 6, truncated=[False] * 6, weight_versions=[v] * 6,
                                       response_lens=[1] * 6)
                for ds in input.datasets
            }
        )


def test_concurrent_external_points_serialize_on_one_backend_built_once(
    prefect_server: str, tiny_model: Path, tmp_path: Path
) -> None:
    import uuid

    from flows.eval_point import eval_point
    from pinned_eval.sinks import JsonlSink
    from tasks.external import backend_lock_name
    from tests.slots import refusals

    env = _external_env(tmp_path)
    options = {"tag": uuid.uuid4().hex[:8]}  # a configuration no other test has built
    SerialProbe.events = []
    states: dict[int, object] = {}
    block = _backend_block(f"{__name__}:SerialProbe", options)

    def point(step: int) -> None:
        snap = _snapshot(tiny_model, tmp_path, step)
        states[step] = eval_point(
            **env.params(step, source={"kind": "hf", "path": snap}, posture="external", max_in_flight=2),
            backend_block=block,
            return_state=True,
        )

    threads = [threading.Thread(target=point, args=(s,)) for s in (21, 22)]
    try:
        with refusals(SerialProbe.events, ("refused", "backend lock")) as refused:  # the other point's wait
            SerialProbe.other_waiting = refused
            for t in threads:
                t.start()
            for t in threads:
                t.join(240)
        assert all(s.name == "Completed" for s in states.values()), states  # type: ignore[attr-defined]
        # the points did overlap: one asked for the backend lock while the other held it (its
        # refusal comes before the first eval ended, which happens inside the lock)
        refused = SerialProbe.events.index(("refused", "backend lock"))
        assert refused < SerialProbe.events.index(next(e for e in SerialProbe.events if e[0] == "evaluated"))
        SerialProbe.events.pop(refused)
        init, *evals = SerialProbe.events
        assert init == ("init", options["tag"]), "constructed once, by the first point"
        assert sorted(evals) == sorted([("pin", "21"), ("evaluated", "21"), ("pin", "22"), ("evaluated", "22")])
        # pin → evaluated of one version, then the other's: never interleaved
        assert evals[0][1] == evals[1][1] and evals[2][1] == evals[3][1], evals
        assert [e[0] for e in evals] == ["pin", "evaluated", "pin", "evaluated"]
        with get_client(sync_client=True) as c:
            limit = c.read_global_concurrency_limit_by_name(backend_lock_name(f"{__name__}:SerialProbe", options))
        assert (limit.limit, limit.active_slots) == (1, 0)
        measured = {(r.step, r.weight_version) for r in JsonlSink(env.jsonl).read(env.run)}
        assert measured == {(21, "21"), (22, "22")}
    finally:
        SerialProbe.other_waiting = None
        BACKENDS.drop(f"{__name__}:SerialProbe", options)
