"""Process kills: the flow-run process SIGKILLed in each phase, and a whole worker host lost.

Each phase is held open by a real stall, so the kill lands where it is meant to:
export — S3 staging behind a proxy that holds the shard upload; pin — engines behind proxies that
hold `/update_weights_from_disk`; generate — a router proxy that holds every `/generate` with a
prompt (the pin's readiness probe passes); log — another writer holds the JSONL sink's lock.

Guarantees: the run ends Crashed, the snapshot is retired (by the `on_crashed` hook run by the
worker), `skipped_crashed` is recorded at the step, the run's next point measures, and the killed
holders' concurrency slots (fleet lock, in-flight bound) come back (lease expiry, ~75 s).
A lost worker host (worker and its flow-run process SIGKILLed): the janitor crashes the zombie
run after the heartbeat window, retires its snapshot and records `skipped_crashed`.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest
from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowRunFilter
from prefect.workers.process import ProcessWorker
from safetensors.torch import load_file, save_file

from blocks import FleetBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.points import inflight_limit_name
from pinned_eval.sinks import JsonlSink
from pinned_eval.snapshot.staging import Staging
from tests.deploykit import REPO, Deployed, flow_run_process, wait_for
from tests.pointkit import CpuFleet, PointEnv, save_point_blocks, write_step_snapshot
from tests.reliability.netfaults import FaultyHTTPProxy, Rule
from tests.s3_fixtures import KEY, SECRET, S3Server

pytestmark = pytest.mark.e2e


@dataclass
class Phase:
    name: str
    env: PointEnv
    step: int
    params: dict
    stalled: Callable[[], bool]
    after_kill: Callable[[], None]
    lock: str | None = None  # a fleet lock the killed point held
    flow_run_id: str = ""


def _tasks(flow_run_id: str) -> list:  # type: ignore[type-arg]
    with get_client(sync_client=True) as c:
        return c.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))


def _task_running(flow_run_id: str, prefix: str) -> bool:
    return any(t.name.startswith(prefix) and t.state and t.state.is_running() for t in _tasks(flow_run_id))




def _read(flow_run_id: str):  # type: ignore[no-untyped-def]
    with get_client(sync_client=True) as c:
        return c.read_flow_run(flow_run_id)


def _active_slots(name: str) -> int:
    with get_client(sync_client=True) as c:
        return c.read_global_concurrency_limit_by_name(name).active_slots


def _staged(env: PointEnv, step: int, tiny: Path) -> dict[str, str]:
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)
    write_step_snapshot(tiny, dest)
    return {"kind": "staged", "path": dest}


def _blocks(where: Path, fleet: FleetBlock) -> PointEnv:
    where.mkdir()
    return save_point_blocks(where, fleet)


def _launch_block(fleet: CpuFleet, name: str) -> FleetBlock:
    return FleetBlock(name=name, mode="launch", state_file=str(fleet.state_file))


@pytest.mark.timeout(280)  # includes the ~75 s lease expiry of the killed holders' slots
def test_flow_run_sigkilled_in_every_phase(
    deployed: Deployed, cpu_fleet: CpuFleet, s3_server: S3Server, tmp_path: Path, tiny_model: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    phases: list[Phase] = []
    proxies: list[FaultyHTTPProxy] = []

    # export: the shard upload to S3 staging is held
    s3 = FaultyHTTPProxy(s3_server.endpoint_url, [Rule("stall", methods=("PUT",), path_contains=".safetensors")])
    proxies.append(s3)
    bucket = s3_server.make_bucket("kill")
    env = _blocks(tmp_path / "export", _launch_block(cpu_fleet, f"k-exp-{tag}"))
    StagingBlock(root=f"s3://{bucket}/stage", endpoint_url=s3.url, aws_access_key_id=KEY,
                 aws_secret_access_key=SECRET, cache_dir=str(tmp_path / "cache"),
                 source_roots=[str(tmp_path), str(tiny_model)]).save(env.blocks["staging"], overwrite=True)
    weights = tmp_path / "w.safetensors"
    save_file({k: v for f in tiny_model.glob("*.safetensors") for k, v in load_file(f).items()}, str(weights))
    phases.append(Phase("export", env, 1, {"source": {"kind": "state_dict", "path": str(weights),
                                                      "hf_base": str(tiny_model)}},
                        stalled=lambda: bool(s3.seen("stall")), after_kill=s3.release))

    # pin: both engines' loads are held
    pin_proxies = [FaultyHTTPProxy(u, [Rule("stall", methods=("POST",), path_contains="/update_weights_from_disk")])
                   for u in cpu_fleet.engine_urls]
    proxies += pin_proxies
    pin_fleet = FleetBlock(name=f"k-pin-{tag}", mode="attach", engine_urls=[p.url for p in pin_proxies],
                           router_url=cpu_fleet.router_url, **cpu_fleet.block_keys())
    env = _blocks(tmp_path / "pin", pin_fleet)
    phases.append(Phase("pin", env, 2, {"source": _staged(env, 2, tiny_model)},
                        stalled=lambda: all(p.seen("stall") for p in pin_proxies),
                        after_kill=lambda: [p.release() for p in pin_proxies], lock=pin_fleet.lock_name))

    # generate: the router proxy holds every prompt (the readiness probe carries input_ids and passes)
    router = FaultyHTTPProxy(cpu_fleet.router_url, [Rule("stall", methods=("POST",), path_contains="/generate",
                                                         body_contains=b'"text"')])
    proxies.append(router)
    gen_fleet = FleetBlock(name=f"k-gen-{tag}", mode="attach", engine_urls=cpu_fleet.engine_urls,
                           router_url=router.url, **cpu_fleet.block_keys())
    env = _blocks(tmp_path / "gen", gen_fleet)
    phases.append(Phase("generate", env, 3, {"source": _staged(env, 3, tiny_model)},
                        stalled=lambda: bool(router.seen("stall")), after_kill=router.release,
                        lock=gen_fleet.lock_name))

    # log: another writer holds the JSONL sink's lock
    env = _blocks(tmp_path / "log", _launch_block(cpu_fleet, gen_fleet.name))
    lock_path = env.jsonl.with_name(env.jsonl.name + ".lock")
    holder = open(lock_path, "a")  # noqa: SIM115 - released right after the kill
    fcntl.flock(holder, fcntl.LOCK_EX)
    log_env = env

    def unlock() -> None:
        fcntl.flock(holder, fcntl.LOCK_UN)
        holder.close()

    phases.append(Phase("log", log_env, 4, {"source": _staged(log_env, 4, tiny_model)},
                        stalled=lambda: _task_running(phases[-1].flow_run_id, "log-"), after_kill=unlock))

    def start(ph: Phase) -> None:
        with get_client(sync_client=True) as c:
            fr = c.create_flow_run_from_deployment(deployed.deployment_id, name=f"{ph.env.run}/step-{ph.step}",
                                                   parameters=ph.env.params(ph.step, max_in_flight=4, **ph.params))
        ph.flow_run_id = str(fr.id)

    def kill_when_held(ph: Phase) -> None:
        wait_for(ph.stalled, 240, f"the {ph.name} phase to be held", interval_s=0.5)
        proc = wait_for(lambda: flow_run_process(deployed.worker_pid, ph.flow_run_id), 30, "the flow-run process")
        os.kill(proc.pid, signal.SIGKILL)
        ph.after_kill()

    export, pin, generate, log = phases
    try:
        # generate and log share the real engines and one fleet lock: log goes through first, and
        # generate starts once log is held in its log phase (past the lock), while export and pin
        # are still on their way to being held: the last kill, which the lease wait below counts
        # from, comes sooner
        for ph in (export, pin, log):
            start(ph)
        kill_when_held(log)
        start(generate)
        for ph in (export, pin, generate):
            kill_when_held(ph)
        for ph in phases:
            done = wait_for(lambda ph=ph: (r := _read(ph.flow_run_id)).state.is_final() and r, 120,
                            f"the {ph.name} kill to be recorded")
            assert done.state.is_crashed(), (ph.name, done.state)
            rows = wait_for(lambda ph=ph: [r for r in JsonlSink(ph.env.jsonl).read(ph.env.run) if r.step == ph.step],
                            60, f"the hook's skipped_crashed row ({ph.name})")
            assert [(r.state, r.reason) for r in rows] == [("failed", "crashed")], (ph.name, rows)
            assert rows[0].metrics["eval/skipped_crashed"] == 1
            store = StagingBlock.load(ph.env.blocks["staging"]).staging()
            left = [s for s in store.list(ph.env.run) if not s.retired]
            assert left == [], f"{ph.name}: unretired snapshots {left}"
        # the run's next point measures (on the real fleet, staging as before)
        for ph in phases:
            nxt = ph.step + 10
            if ph.name == "export":
                local = write_step_snapshot(tiny_model, str(tmp_path / f"next-{nxt}"))
                store = StagingBlock.load(ph.env.blocks["staging"]).staging()
                source = {"kind": "staged", "path": store.put(local, ph.env.run, nxt)}
            else:
                source = _staged(ph.env, nxt, tiny_model)
            state = eval_point(**ph.env.params(nxt, source=source, max_in_flight=4, fleet=_save_next(cpu_fleet, tag)),
                               return_state=True)
            assert state.name == "Completed", (ph.name, state.message)
        # and every slot the killed points held comes back (lease expiry)
        names = [ph.lock for ph in phases if ph.lock] + [inflight_limit_name(ph.env.run) for ph in phases]
        wait_for(lambda: all(_active_slots(n) == 0 for n in names), 150, f"leases of {names} to expire", interval_s=0.5)
    finally:
        for p in proxies:
            p.close()


def _save_next(fleet: CpuFleet, tag: str) -> str:
    name = f"next-{tag}"
    _launch_block(fleet, f"k-next-{tag}").save(name, overwrite=True)
    return name


# ---- a worker host lost with a run in flight ---------------------------------------------------


def test_lost_worker_host_is_cleaned_up_by_the_janitor(
    deployed: Deployed, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path
) -> None:
    from flows.janitor import janitor, last_activity

    pool, tag = f"rel-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:6]
    env_vars = dict(os.environ, PREFECT_API_URL=deployed.api_url, PINNED_EVAL_PROJECT_DIR=str(REPO))
    with get_client(sync_client=True) as c:  # the API, not `prefect work-pool create`: one Prefect import less
        c.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                          base_job_template=ProcessWorker.get_default_base_job_template()))
    # the worker starts first: its start-up (a Prefect import) overlaps the setup below
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115
    worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"],
                              cwd=REPO, env=dict(env_vars, PREFECT_WORKER_QUERY_SECONDS="1"), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    held: list[FaultyHTTPProxy] = []
    try:
        with get_client(sync_client=True) as c:
            flow_id = c.read_flow_by_name("eval-point").id
            dep_id = c.create_deployment(
                flow_id=flow_id, name=f"lost-host-{tag}", work_pool_name=pool,
                entrypoint="flows/eval_point.py:eval_point",
                pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}],
            )
        held += [FaultyHTTPProxy(u, [Rule("stall", methods=("POST",), path_contains="/update_weights_from_disk")])
                 for u in cpu_fleet.engine_urls]
        fleet = FleetBlock(name=f"lost-{tag}", mode="attach", engine_urls=[p.url for p in held],
                           router_url=cpu_fleet.router_url, **cpu_fleet.block_keys())
        env = save_point_blocks(tmp_path, fleet)
        source = _staged(env, 5, tiny_model)
        with get_client(sync_client=True) as c:
            fr = c.create_flow_run_from_deployment(dep_id, parameters=env.params(5, source=source),
                                                   name=f"{env.run}/step-5")
        wait_for(lambda: all(p.seen("stall") for p in held), 240, "the point to be in flight (pinning)")
        # the host is gone: the worker and every process under it (the flow-run process runs in a
        # session of its own, so the worker's process group is not enough); nobody reports anything
        host = [psutil.Process(worker.pid), *psutil.Process(worker.pid).children(recursive=True)]
        assert any(p.pid != worker.pid for p in host), "the flow-run process runs under the worker"
        for p in host:
            p.send_signal(signal.SIGKILL)
        worker.wait(30)
    finally:
        for p in held:
            p.close()
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        log.close()
    assert _read(str(fr.id)).state.is_running(), "a zombie: nobody reported the loss"

    def quiet_for(seconds: float) -> bool:
        with get_client(sync_client=True) as c:
            return (datetime.now(UTC) - last_activity(c, c.read_flow_run(fr.id))).total_seconds() > seconds

    wait_for(lambda: quiet_for(4), 60, "the zombie to be quiet past the window")
    report = janitor(heartbeat_window_s=3, run=env.run, staging=[env.blocks["staging"]])
    zombie = _read(str(fr.id))
    assert [p.flow_run_id for p in report.crashed] == [str(fr.id)], (report, zombie.state, zombie.tags)
    state = _read(str(fr.id)).state
    assert state.is_crashed() and state.message.startswith("janitor: no activity")
    store: Staging = StagingBlock.load(env.blocks["staging"]).staging()
    assert [(s.step, s.retired) for s in store.list(env.run)] == [(5, True)]
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert (row.step, row.reason, row.flow_run_id) == (5, "crashed", str(fr.id))
