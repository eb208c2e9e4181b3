"""Scale-out: a Postgres-backed Prefect server, two process workers on one pool, two fleets.

The test starts its own PostgreSQL on 127.0.0.1 (initdb into a temp dir; as the `postgres` user
when run as root), a `prefect server start` on it (`PREFECT_API_DATABASE_CONNECTION_URL`), deploys
`prefect.yaml` and starts two process workers (`--limit 1` each, as two nodes would) on pool
`pinned-eval`. Two training runs dispatch three points each, one run per fleet (the session's
2-engine CPU fleet and a 1-engine fleet launched here), so the fleet locks `fleet-<name>` differ
and points of different fleets run side by side.

Checked: every point is measured and proves its pin; both workers executed points (the server's
`prefect.worker.executed-flow-run` events, cross-checked in each worker's own log); the flow runs
live in Postgres (read back with psql); both fleet locks exist with limit 1 and end free.
Skipped with a reason when PostgreSQL's server binaries are absent (`scripts/ci-services.sh`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.workers.process import ProcessWorker

from app.prefect_server import ServerProcess, env_set, free_port, start_server, stop_server, use_server
from bench.burst import (
    LocalPostgres,
    PostgresUnavailableError,
    postgres_bin,
    running_postgres,
    snapshot_exporter,
    tiny_suite,
)
from blocks import FleetBlock
from pinned_eval.events import BlockNames
from pinned_eval.settings import PrefectApiSettings
from tests.deploykit import REPO, prefect_cli, wait_for
from tests.pointkit import CpuFleet, PointEnv, save_point_blocks
from tests.prefect_server import prefect_rest_client
from trainer_integration.client import EvalClient
from trainer_integration.results import PointOutcome

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORKERS = ("node-a", "node-b")
STEPS = 3


@dataclass(frozen=True)
class Worker:
    name: str
    pid: int
    log: Path


@dataclass(frozen=True)
class PostgresStack:
    pg: LocalPostgres
    api_url: str
    home: Path
    workers: tuple[Worker, ...]
    auth_string: str  # the server's API credential


def _start_worker(name: str, env: dict[str, str], log: Path) -> Worker:
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "pinned-eval", "--type", "process",
             "--name", name, "--limit", "1"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return Worker(name, proc.pid, log)


def _stop_workers(workers: list[Worker]) -> None:
    """SIGTERM every worker at once, then wait for each (SIGKILL after 20 s): their graceful
    shutdowns overlap instead of adding up."""
    for worker in workers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGTERM)
    for worker in workers:
        try:
            wait_for(lambda w=worker: _gone(w.pid), 20, f"worker {worker.name} to stop", 0.2)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid


def _create_pool(server: ServerProcess, home: Path) -> None:
    """Process pool `pinned-eval`, through the API (`prefect work-pool create` costs a Prefect import)."""
    pool = WorkPoolCreate(name="pinned-eval", type="process",
                          base_job_template=ProcessWorker.get_default_base_job_template())
    with use_server(server.api_url, home, auth_string=server.auth_string), get_client(sync_client=True) as c:
        c.create_work_pool(pool)


@pytest.fixture(scope="module")
def postgres_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresStack]:
    try:
        postgres_bin()
    except PostgresUnavailableError as exc:
        pytest.skip(f"scale-out test needs PostgreSQL: {exc}")
    home = tmp_path_factory.mktemp("pg-prefect-home")
    with running_postgres(free_port()) as pg:
        with env_set(PREFECT_API_DATABASE_CONNECTION_URL=pg.url):
            server = start_server(home)
        workers: list[Worker] = []
        try:
            env = dict(os.environ, PREFECT_API_URL=server.api_url, PREFECT_HOME=str(home),
                       PINNED_EVAL_PROJECT_DIR=str(REPO), PREFECT_API_AUTH_STRING=server.auth_string)
            _create_pool(server, home)
            worker_env = dict(env, PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="1",
                              PREFECT_LOGGING_LEVEL="INFO")
            logs = tmp_path_factory.mktemp("pg-workers")
            # the workers start up (a Prefect import each) while `prefect deploy` runs
            workers = [_start_worker(n, worker_env, logs / f"{n}.log") for n in WORKERS]
            dep = prefect_cli("--no-prompt", "deploy", "--all", env=env)
            assert dep.returncode == 0, dep.stdout + dep.stderr
            yield PostgresStack(pg, server.api_url, home, tuple(workers), server.auth_string)
        finally:
            _stop_workers(workers)
            stop_server(server.pid)


def executed_by(api_url: str, auth_string: str) -> dict[str, str]:
    """flow run id -> name of the worker that executed it, from `prefect.worker.executed-flow-run` events."""
    body = {"filter": {"event": {"name": ["prefect.worker.executed-flow-run"]}}, "limit": 50}
    out: dict[str, str] = {}
    auth = PrefectApiSettings.from_environ({"PREFECT_API_AUTH_STRING": auth_string}).auth_headers()
    with prefect_rest_client(headers=auth) as http:
        page = http.post(f"{api_url}/events/filter", json=body).raise_for_status().json()
        while True:
            for event in page["events"]:
                worker = event["resource"]["prefect.resource.name"]
                for rel in event.get("related", []):
                    if rel.get("prefect.resource.role") == "flow-run":
                        out[rel["prefect.resource.id"].removeprefix("prefect.flow-run.")] = worker
            if not page.get("next_page"):
                return out
            page = http.get(page["next_page"]).raise_for_status().json()


def _client(env: PointEnv, api_url: str, tiny_model: Path, spool: Path) -> EvalClient:
    return EvalClient(
        env.run, api_url, blocks=BlockNames(**env.blocks), policy="backpressure", max_in_flight=STEPS,
        staging_root=env.staging_root, exporter=snapshot_exporter(tiny_model), spool_dir=spool,
    )


@pytest.mark.timeout(300)
def test_points_spread_over_two_workers_and_two_fleets_on_postgres(
    postgres_stack: PostgresStack, cpu_fleet: CpuFleet, tiny_model: Path, tmp_path: Path
):
    from pinned_eval.fleet.launcher import launch_cpu_fleet

    api_url = postgres_stack.api_url
    fleet_b = launch_cpu_fleet(tiny_model, 1, state_file=tmp_path / "fleet-b.json", ready_timeout_s=180)
    try:
        with use_server(api_url, postgres_stack.home, auth_string=postgres_stack.auth_string):
            envs: list[PointEnv] = []
            for name, state in (("scale-a", cpu_fleet.state_file), ("scale-b", tmp_path / "fleet-b.json")):
                (tmp_path / name).mkdir()
                fleet = FleetBlock(name=name, mode="launch", state_file=str(state))
                envs.append(save_point_blocks(tmp_path / name, fleet, suite=tiny_suite(), keep_snapshots=1))
            clients = [_client(e, api_url, tiny_model, tmp_path / "spool") for e in envs]
            try:
                for step in range(STEPS):
                    for c in clients:
                        assert c.dispatch(step, final=step == STEPS - 1).action == "requested"
                outcomes = {c.run: c.drain(timeout=200) for c in clients}
            finally:
                for c in clients:
                    c.close()
            with get_client(sync_client=True) as pc:
                locks = {n: pc.read_global_concurrency_limit_by_name(f"fleet-{n}") for n in ("scale-a", "scale-b")}
    finally:
        fleet_b.stop()

    # every point measured and pinned to its own step's weights
    flow_run_ids: list[str] = []
    for points in outcomes.values():
        assert [o.step for o in points] == list(range(STEPS)), points
        for o in points:
            _assert_pinned(o)
            assert o.flow_run_id is not None
            flow_run_ids.append(o.flow_run_id)

    # both workers executed points; each point by exactly one of them, as its own log says
    executed = wait_for(
        lambda: (ex := executed_by(api_url, postgres_stack.auth_string)) and set(flow_run_ids) <= set(ex) and ex,
        60,
        "executed-flow-run events",
    )
    assert {executed[i] for i in flow_run_ids} == set(WORKERS), executed
    # each worker's own log agrees: the executing worker submitted the run and was not turned
    # away; a worker that raced for the same run was (the server allows one PENDING transition)
    logs = {w.name: w.log.read_text() for w in postgres_stack.workers}
    races = 0
    for fr in flow_run_ids:
        ran = [n for n, text in logs.items() if f"submitting flow run '{fr}'" in text and _aborted(fr) not in text]
        assert ran == [executed[fr]], (fr, executed[fr])
        races += sum(1 for text in logs.values() if _aborted(fr) in text)
    print("points per worker:", {w: sum(1 for i in flow_run_ids if executed[i] == w) for w in WORKERS},
          "submissions turned away by the server:", races)

    # the orchestration state lives in Postgres
    for run in outcomes:
        assert postgres_stack.pg.psql(f"select count(*) from flow_run where name like '{run}/step-%'") == str(STEPS)
    # one pin lock per fleet, limit 1, free again
    for name, lock in locks.items():
        assert lock.limit == 1 and lock.active_slots == 0, (name, lock)


def _aborted(flow_run_id: str) -> str:
    return f"Aborted submission of flow run '{flow_run_id}'"


def _assert_pinned(o: PointOutcome) -> None:
    assert o.state == "measured" and o.flow_runs == 1, o
    [metrics] = o.metrics.values()
    assert metrics["eval/arith_add/weight_version/mean"] == o.step, metrics
    assert metrics["eval/arith_add/weight_version/mixed_version_ratio"] == 0, metrics
