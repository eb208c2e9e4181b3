"""Engine faults against the real CPU fleet behind sglang-router, through the eval-point flow.

- an engine SIGKILLed mid-generation: the point is skipped `unhealthy` (or, when the router
  retried on the live engine, measured at exactly its version); the next point revives the
  engine and pins it;
- an engine that loads but reports another weight version / another model_path:
  `pin_violation` after two attempts, and not one generation request reaches any engine;
- a load that fails inside the engine after the completeness check passed (a shard whose
  tensors do not fit the model): the engine's weights are unknown, it serves nothing (503) and is
  out of the router until a good load heals it at the next point.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from prefect import get_client

from blocks import FleetBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.fleet.launcher import LaunchedFleet
from pinned_eval.sinks import JsonlSink
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults
from tests.faults import RelabelingProxy
from tests.pointkit import CpuFleet, PointEnv, save_point_blocks, write_step_snapshot
from tests.reliability.netfaults import FaultyHTTPProxy

pytestmark = pytest.mark.e2e

LONG_SUITE = EvalSuite(
    datasets=(DatasetSpec(name="arith_add", path="builtin:arith_add.jsonl", max_prompts=16),),
    defaults=SamplingDefaults(temperature=0.0, max_new_tokens=48, n_samples_per_prompt=2, reward="exact_match"),
)


def run_point(env: PointEnv, step: int, **params: object):  # type: ignore[no-untyped-def]
    return eval_point(**env.params(step, **params), return_state=True)


def staged(env: PointEnv, step: int, base: Path) -> dict[str, str]:
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)
    write_step_snapshot(base, dest)
    return {"kind": "staged", "path": dest}


def counters(fleet: CpuFleet, url: str) -> dict[str, int]:
    info = httpx.get(f"{url}/server_info", headers=fleet.headers(), timeout=30).json()["internal_states"][0]
    return {k: info[k] for k in ("requests_finished", "requests_aborted", "weight_loads", "weight_load_failures")}


def model_info(fleet: CpuFleet, url: str) -> dict:
    return httpx.get(f"{url}/model_info", headers=fleet.headers(), timeout=30).json()


def launch_env(tmp_path: Path, fleet: CpuFleet, suite: EvalSuite | None = None) -> PointEnv:
    block = FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(fleet.state_file))
    return save_point_blocks(tmp_path, block, **({"suite": suite} if suite else {}))


@pytest.mark.parametrize("lie", ["weight_version", "model_path"])
def test_engine_that_misreports_is_pin_violation_and_generates_nothing(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path, lie: str
) -> None:
    liar, honest = cpu_fleet.engine_urls
    if lie == "weight_version":
        proxy = RelabelingProxy(liar, "999")
    else:
        def other_path(method: str, path: str, body: bytes) -> bytes:
            if not path.startswith("/model_info"):
                return body
            return json.dumps({**json.loads(body), "model_path": "/elsewhere/step_00000041"}).encode()

        proxy = FaultyHTTPProxy(liar, rewrite=other_path)
    before = {u: counters(cpu_fleet, u) for u in cpu_fleet.engine_urls}
    try:
        fleet = FleetBlock(name=f"liar-{lie[:5]}", mode="attach", engine_urls=[proxy.url, honest],
                           router_url=cpu_fleet.router_url, **cpu_fleet.block_keys())
        env = save_point_blocks(tmp_path, fleet)
        state = run_point(env, 41, source=staged(env, 41, tiny_model))
    finally:
        proxy.close()
    assert state.name == "Skipped" and state.message.startswith("pin_violation"), state.message
    assert f"reads back {lie}" in state.message, state.message
    after = {u: counters(cpu_fleet, u) for u in cpu_fleet.engine_urls}
    for url in cpu_fleet.engine_urls:
        assert after[url]["weight_loads"] - before[url]["weight_loads"] == 2, "two pin attempts on every engine"
        for key in ("requests_finished", "requests_aborted"):
            assert after[url][key] == before[url][key], f"{url} generated after a failed pin ({key})"
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert row.metrics["eval/skipped_pin_violation"] == 1 and row.step == 41


def test_load_failing_inside_the_engine_leaves_it_unserving_until_a_good_load(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path
) -> None:
    from engine.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "wider", hidden_size=96)  # same family, tensors of other shapes
    env = launch_env(tmp_path, cpu_fleet)
    pids = {u: LaunchedFleet.load(cpu_fleet.state_file).pid_of(u) for u in cpu_fleet.engine_urls}
    bad = staged(env, 51, other)  # complete and well-formed: the orchestrator's check passes it
    state = run_point(env, 51, source=bad)
    assert state.name == "Skipped" and state.message.startswith("pin_violation"), state.message
    assert "load failed" in state.message
    for url in cpu_fleet.engine_urls:
        info = httpx.get(f"{url}/server_info", headers=cpu_fleet.headers(), timeout=30).json()["internal_states"][0]
        assert info["weights_ok"] is False, "a failed load leaves the weights unknown"
        assert httpx.get(f"{url}/health", timeout=30).status_code == 503
        refused = httpx.post(f"{url}/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 1}},
                             headers=cpu_fleet.headers(), timeout=30)
        assert refused.status_code == 503, "an engine with unknown weights serves nothing"
    good = run_point(env, 52, source=staged(env, 52, tiny_model))
    assert good.name == "Completed", good.message
    for url in cpu_fleet.engine_urls:
        assert model_info(cpu_fleet, url)["weight_version"] == "52"
        assert LaunchedFleet.load(cpu_fleet.state_file).pid_of(url) == pids[url], "reloaded in place, not restarted"
    rows = JsonlSink(env.jsonl).read(env.run)
    assert [r.reason for r in rows if r.step == 51] == ["pin_violation"]
    measured = [r for r in rows if r.step == 52]
    assert {r.dataset for r in measured} == {"arith_add", "arith_sub"}
    assert all(r.state == "measured" and r.metrics[f"eval/{r.dataset}/weight_version/mean"] == 52 for r in measured)


def _generation_started(fleet: CpuFleet, url: str, before: int, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            if counters(fleet, url)["requests_finished"] > before:
                return True
        except httpx.TransportError:
            return False
        time.sleep(0.05)
    return False


def test_engine_sigkilled_mid_generation_then_revived_and_pinned(
    prefect_server: str, fleet_reaper: CpuFleet, tmp_path: Path, tiny_model: Path
) -> None:
    fleet = fleet_reaper
    victim = fleet.engine_urls[0]
    launched = LaunchedFleet.load(fleet.state_file)
    old_pid = launched.pid_of(victim)
    env = launch_env(tmp_path, fleet, suite=LONG_SUITE)
    src = staged(env, 61, tiny_model)
    before = counters(fleet, victim)["requests_finished"]
    stop, killed = threading.Event(), threading.Event()

    def killer() -> None:
        if _generation_started(fleet, victim, before + 1, stop):  # +1: the router readiness probe of the pin
            os.kill(old_pid, signal.SIGKILL)
            killed.set()

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    state = run_point(env, 61, source=src)
    stop.set()
    t.join(10)
    assert killed.is_set(), "the engine was killed while the point generated"
    rows = JsonlSink(env.jsonl).read(env.run)
    if state.name == "Skipped":
        assert state.message.startswith("unhealthy"), state.message
        assert rows[0].metrics["eval/skipped_unhealthy"] == 1
    else:  # the router re-sent the lost requests to the live engine: still exactly version 61
        assert state.name == "Completed", state.message
        assert all(r.metrics["eval/arith_add/weight_version/mean"] == 61 for r in rows)
        assert all(r.metrics["eval/arith_add/weight_version/mixed_version_ratio"] == 0 for r in rows)
    nxt = run_point(env, 62, source=staged(env, 62, tiny_model))
    assert nxt.name == "Completed", nxt.message
    new_pid = LaunchedFleet.load(fleet.state_file).pid_of(victim)
    assert new_pid != old_pid, "the dead engine was relaunched"
    for url in fleet.engine_urls:
        assert model_info(fleet, url)["weight_version"] == "62", "and pinned with its peer"
    [row] = [r for r in JsonlSink(env.jsonl).read(env.run) if r.step == 62]
    assert row.metrics["eval/arith_add/weight_version/mean"] == 62
    with get_client(sync_client=True) as c:
        assert c.read_flow_run(nxt.state_details.flow_run_id).state.is_completed()
