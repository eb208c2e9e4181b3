"""Two real CPU engines behind the real sglang-router, launched and pinned by pinned-eval's fleet code.

One fleet serves the whole module (engine start-up dominates); every test pins what it needs first.
The "lying" engine is a real engine behind a pass-through proxy that, right after forwarding a
successful `/update_weights_from_disk`, relabels the engine through its own `/update_weight_version`:
the engine then truly reports another version on `/model_info`, as a stale or misbehaving engine would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from pinned_eval.fleet import (
    FleetClient,
    FleetConfig,
    HealthState,
    LaunchedFleet,
    PinViolation,
    SamplingParams,
    WeightVersionMismatch,
    launch_cpu_fleet,
)
from tests.faults import RelabelingProxy

pytestmark = pytest.mark.e2e

CONFIG = FleetConfig(alive_timeout_s=60, poll_interval_s=0.2, router_ready_timeout_s=60, worker_timeout_s=60)
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


def _auth(fleet: LaunchedFleet, *, admin: bool = False) -> dict[str, str]:
    """Bearer header with the fleet's (generated) API key, or its admin key."""
    assert fleet.keys is not None
    return {"Authorization": f"Bearer {fleet.keys.admin if admin else fleet.keys.api}"}


@pytest.fixture(scope="module")
def snapshots(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engine.tiny_model import perturb_snapshot

    root = tmp_path_factory.mktemp("snapshots")
    return {
        "A": perturb_snapshot(tiny_model_dir, root / "step_3", seed=3),
        "B": perturb_snapshot(tiny_model_dir, root / "step_6", seed=6),
    }


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedFleet]:
    root = tmp_path_factory.mktemp("fleet")
    launched = launch_cpu_fleet(
        tiny_model_dir, 2, state_file=root / "fleet.json", weight_version="0", ready_timeout_s=180
    )
    try:
        yield launched
    finally:
        launched.stop()


async def test_pin_is_read_back_on_every_engine_and_every_response_carries_it(
    fleet: LaunchedFleet, snapshots: dict[str, Path]
) -> None:
    async with fleet.client(CONFIG) as client:
        result = await client.pin(snapshots["A"], "3")
        infos = [await client.probe(u) for u in fleet.engine_urls]
        outs = [await client.generate(f"{i}+1=", sampling_params=GREEDY, rid=f"p{i}") for i in range(6)]
    assert result.attempts == 1 and sorted(result.router_workers) == sorted(fleet.engine_urls)
    assert [(i.weight_version, i.model_path) for i in infos] == [("3", str(snapshots["A"]))] * 2
    assert [o.meta_info.weight_version for o in outs] == ["3"] * 6
    assert all(o.finish_type in ("length", "stop") and o.meta_info.completion_tokens >= 1 for o in outs)


async def test_bad_path_is_400_and_leaves_the_engines_unhealthy_until_a_good_load(
    fleet: LaunchedFleet, snapshots: dict[str, Path], tmp_path: Path
) -> None:
    async with fleet.client(CONFIG) as client:
        await client.pin(snapshots["A"], "3")
        with pytest.raises(PinViolation) as err:
            await client.pin(tmp_path / "no-such-snapshot", "4")
        assert {c.load.status_code for c in err.value.checks} == {400}
        assert all(c.weight_version == "3" for c in err.value.checks)  # the version moves only on success
        views = await client.fleet_health()
        assert all(not v.serving and not v.weights_known and v.loadable for v in views)
        assert await client.router.list_workers() == []  # unverified engines leave the router
        with httpx.Client() as http:
            assert {http.get(f"{u}/health").status_code for u in fleet.engine_urls} == {503}
        await client.pin(snapshots["A"], "5")
        assert all(v.serving and v.state is HealthState.UP for v in await client.fleet_health())
        assert sorted(w.url for w in await client.router.list_workers()) == sorted(fleet.engine_urls)
        assert (await client.generate("1+1=", sampling_params=GREEDY)).weight_version == "5"


def test_unknown_sampling_key_is_400(fleet: LaunchedFleet) -> None:
    with httpx.Client() as http:
        resp = http.post(f"{fleet.engine_urls[0]}/generate", json={"text": "1+1=", "sampling_params": {"seed": 7}},
                         headers=_auth(fleet))
    assert resp.status_code == 400 and "seed" in resp.text
    with pytest.raises(ValueError, match="seed"):
        SamplingParams.model_validate({"seed": 7})  # the client refuses it before sending


async def test_engine_killed_between_pins_is_revived_and_the_next_pin_succeeds(
    fleet: LaunchedFleet, snapshots: dict[str, Path]
) -> None:
    victim = fleet.engine_urls[1]
    async with fleet.client(CONFIG) as client:
        await client.pin(snapshots["A"], "3")
        old_pid = fleet.pid_of(victim)
        os.kill(old_pid, signal.SIGKILL)
        psutil.Process(old_pid).wait(timeout=10)
        result = await client.pin(snapshots["B"], "6")
        infos = [await client.probe(u) for u in fleet.engine_urls]
        outs = [await client.generate(f"{i}*2=", sampling_params=GREEDY) for i in range(4)]
    assert result.revived == [victim] and fleet.pid_of(victim) != old_pid
    assert [(i.weight_version, i.model_path) for i in infos] == [("6", str(snapshots["B"]))] * 2
    assert sorted(result.router_workers) == sorted(fleet.engine_urls)
    assert {o.weight_version for o in outs} == {"6"}
    saved = json.loads(Path(fleet.state_file).read_text())  # another process sees the new PID
    assert fleet.pid_of(victim) in [e["pid"] for e in saved["engines"]]


async def test_engine_reporting_another_version_fails_the_pin_after_two_attempts(
    fleet: LaunchedFleet, snapshots: dict[str, Path]
) -> None:
    liar_engine, honest = fleet.engine_urls
    proxy = RelabelingProxy(liar_engine, "999")
    try:
        async with FleetClient([proxy.url, honest], config=fleet.client_config(CONFIG)) as client:
            with pytest.raises(PinViolation) as err:
                await client.pin(snapshots["A"], "7")
    finally:
        proxy.close()
    assert err.value.reason == "pin_violation" and err.value.attempts == 2 and proxy.loads == 2
    bad = [c for c in err.value.checks if not c.ok]
    assert [(c.url, c.weight_version) for c in bad] == [(proxy.url, "999")]
    with httpx.Client() as http:  # the engine itself reports the other version
        assert http.get(f"{liar_engine}/model_info", headers=_auth(fleet)).json()["weight_version"] == "999"


async def test_a_response_from_another_version_is_refused(fleet: LaunchedFleet, snapshots: dict[str, Path]) -> None:
    async with fleet.client(CONFIG) as client:
        await client.pin(snapshots["A"], "8")
        with httpx.Client() as http:  # one engine drifts behind the client's back
            relabel = {"new_version": "8-drifted", "abort_all_requests": False}
            http.post(f"{fleet.engine_urls[0]}/update_weight_version", json=relabel,
                      headers=_auth(fleet, admin=True)).raise_for_status()
        with pytest.raises(WeightVersionMismatch) as err:
            for i in range(4):  # round robin reaches the drifted engine within two requests
                await client.generate(f"{i}+3=", sampling_params=GREEDY)
    assert err.value.got == "8-drifted" and err.value.expected == "8"


def test_fleet_up_and_down_from_separate_processes(tiny_model_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "cli-fleet.json"
    cli = [sys.executable, "-m", "app.cli", "fleet"]
    up = subprocess.run(
        [
            *cli,
            "up",
            "--engines",
            "1",
            "--model-path",
            str(tiny_model_dir),
            "--weight-version",
            "9",
            "--state-file",
            str(state),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    try:
        assert up.returncode == 0, up.stderr
        lines = dict(line.split(" ", 1) for line in up.stdout.splitlines())
        auth = _auth(LaunchedFleet.load(state))  # `fleet up` generated the keys; the state file holds them
        with httpx.Client(headers=auth) as http:
            assert http.get(f"{lines['engine']}/model_info").json()["weight_version"] == "9"
            probe = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
            assert http.post(f"{lines['router']}/generate", json=probe).json()["meta_info"]["weight_version"] == "9"
        pids = [r["pid"] for r in [*json.loads(state.read_text())["engines"], json.loads(state.read_text())["router"]]]
        again = subprocess.run(
            [*cli, "up", "--engines", "1", "--model-path", str(tiny_model_dir), "--state-file", str(state)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode == 2 and "still running" in again.stderr
    finally:
        down = subprocess.run([*cli, "down", "--state-file", str(state)], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert not state.exists()
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


async def test_router_membership_add_and_remove(fleet: LaunchedFleet, snapshots: dict[str, Path]) -> None:
    from pinned_eval.fleet import RouterError
    from tests.conftest import free_port

    first, second = fleet.engine_urls
    async with fleet.client(CONFIG) as client:
        await client.pin(snapshots["A"], "10")
        router = client.router
        assert await router.remove_worker(second) is True
        assert [w.url for w in await router.list_workers()] == [first]
        assert await router.remove_worker(second) is False  # not a member any more
        assert (await client.generate("2+2=", sampling_params=GREEDY)).weight_version == "10"
        added = await router.add_worker(second)
        assert added.url == second and added.is_healthy
        with pytest.raises(RouterError, match="not listed"):
            await router.add_worker(f"http://127.0.0.1:{free_port()}", timeout_s=1.5)
        assert sorted(w.url for w in await router.list_workers()) == sorted(fleet.engine_urls)


async def test_engine_400s_for_over_long_requests_leave_the_router_routing_and_the_next_pin_clean(
    fleet: LaunchedFleet, snapshots: dict[str, Path], tiny_model_dir: Path
) -> None:
    """An engine's 400 is the request's fault: eleven per engine (past sglang-router's default circuit
    breaker threshold of ten) must not take the engines out of the router's rotation, so the next
    point's pin succeeds on its first attempt and the router answers its very next 1-token generate."""
    ctx = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    over_long = {"text": "1+1=", "sampling_params": {"max_new_tokens": ctx, "temperature": 0.0}}
    statuses = [
        httpx.post(f"{fleet.router_url}/generate", json=over_long, headers=_auth(fleet), timeout=60).status_code
        for _ in range(11 * len(fleet.engine_urls))
    ]
    assert statuses == [400] * (11 * len(fleet.engine_urls))
    probe = {"text": "1+1=", "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    after = httpx.post(f"{fleet.router_url}/generate", json=probe, headers=_auth(fleet), timeout=60)
    assert after.status_code == 200, after.text
    async with fleet.client(CONFIG) as client:
        workers = await client.router.list_workers()
        assert sorted((w.url, w.is_healthy) for w in workers) == sorted((u, True) for u in fleet.engine_urls)
        result = await client.pin(snapshots["B"], "6")
        out = await client.generate("2+2=", sampling_params=GREEDY, rid="after-400s")
    assert result.attempts == 1 and result.revived == []
    assert out.meta_info.weight_version == "6"
