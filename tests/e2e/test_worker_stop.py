"""Journey 4 of issue 20: `pinned-eval worker` stops cleanly. The real CLI runs as a subprocess on a
fresh home against the session's Prefect server, on a pool of its own (no deployment targets it,
so it never takes another test's flow run). SIGTERM or SIGINT stops every process it started, the
backend host disposing its backends; SIGKILL leaves nothing polling the pool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from prefect import get_client
from prefect.exceptions import PrefectHTTPStatusError

from app.stack import LocalStack, StackState
from app.warm_start import write_job_template
from pinned_eval.backend_host import evaluate_hosted, host_health
from pinned_eval.events import EVENT_FAILED, point_resource
from pinned_eval.external import EvalInput
from pinned_eval.local_socket import answers
from pinned_eval.polling import poll_until
from pinned_eval.processes import pid_alive
from pinned_eval.sinks import JsonlSink
from pinned_eval.sinks.outbox import Outbox
from tests.conftest import free_port
from tests.deploykit import REPO, prefect_cli
from tests.eventkit import related_flow_runs, settled_events
from tests.hosted_backends import read_lifecycle
from tests.pointkit import SMALL_SUITE, PointEnv, save_point_blocks, write_step_snapshot
from tests.wandb_offline import history_rows

pytestmark = pytest.mark.e2e
BACKEND = "tests.hosted_backends:LifecycleBackend"


@dataclass
class WorkerCli:
    proc: subprocess.Popen[bytes]
    stack: LocalStack
    pool: str
    log: Path

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)


def fresh_home(tmp_path: Path, api_url: str) -> Path:
    """A new home that names the session's server and holds its credential (as `server up` writes them)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    state = StackState(api_url=api_url, prefect_home=str(tmp_path / "prefect-home"))
    (home / "stack.json").write_text(state.model_dump_json())
    fd = os.open(home / "api-auth", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.environ["PREFECT_API_AUTH_STRING"].encode())
    os.close(fd)
    return home


def _workers_on(pool: str) -> list[object]:
    with get_client(sync_client=True) as c:
        try:
            return list(c.read_workers_for_work_pool(pool))
        except PrefectHTTPStatusError as exc:  # 404: the worker creates its pool as it starts
            if exc.response.status_code == 404:
                return []
            raise


@pytest.fixture
def worker_cli(prefect_server: str, tmp_path: Path) -> Iterator[WorkerCli]:
    home = fresh_home(tmp_path, prefect_server)
    pool = f"stop-{uuid.uuid4().hex[:8]}"
    template = write_job_template(tmp_path / "warm-template.json")  # the pool `pinned-eval deploy` creates
    made = prefect_cli("work-pool", "create", pool, "--type", "process", "--base-job-template", str(template),
                       env=dict(os.environ))
    assert made.returncode == 0, made.stdout + made.stderr
    log = tmp_path / "cli.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PINNED_EVAL_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "worker", "--pool", pool], cwd=REPO,
                                env=dict(env, PINNED_EVAL_HOME=str(home)), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    cli = WorkerCli(proc, LocalStack(home), pool, log)
    try:
        poll_until(lambda: _up(cli), timeout_s=180, interval_s=0.5, what=lambda: f"worker up; log:\n{log.read_text()}")
        yield cli
    finally:
        for p in [psutil.Process(proc.pid), *cli.descendants()] if proc.poll() is None else []:
            p.kill()
        proc.wait(timeout=30)


def _up(cli: WorkerCli) -> bool:
    if cli.proc.poll() is not None:
        raise AssertionError(f"the CLI exited with {cli.proc.returncode}:\n{cli.log.read_text()}")
    st = cli.stack.state()
    pids = (st.worker_pid, st.warm_pid, st.backend_host_pid, st.deliverer_pid)
    if not all(pid and pid_alive(pid) for pid in pids):
        return False
    return (answers(cli.stack.warm_socket()) and cli.stack.backend_socket().exists()
            and Outbox(cli.stack.outbox()).served() and bool(_workers_on(cli.pool)))


def _gone(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running (same PID and start time, not a zombie)."""
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            continue
    return left


def _pollers(pool: str) -> list[int]:
    """Processes running a Prefect worker on `pool`."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "worker" in cmd and "start" in cmd and pool in cmd:
            found.append(p.pid)
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_worker_its_fork_server_and_host_which_disposes_its_backends(
    worker_cli: WorkerCli, tmp_path: Path, signum: signal.Signals
) -> None:
    lifecycle = str(tmp_path / "lifecycle.jsonl")
    inp = EvalInput(run="exp42", step=1, hf_dir="/s", suite=SMALL_SUITE)
    evaluate_hosted(worker_cli.stack.backend_socket(), BACKEND, {"log": lifecycle}, "/s", inp)
    st = worker_cli.stack.state()
    assert host_health(worker_cli.stack.backend_socket())["pid"] == st.backend_host_pid
    started = worker_cli.descendants()
    assert {st.worker_pid, st.warm_pid, st.backend_host_pid, st.deliverer_pid} <= {p.pid for p in started}

    os.kill(worker_cli.proc.pid, signum)
    assert worker_cli.proc.wait(timeout=90) == 0, worker_cli.log.read_text()

    assert _gone(started) == [], "every process the CLI started is stopped before it exits"
    assert _pollers(worker_cli.pool) == []
    assert [e["event"] for e in read_lifecycle(lifecycle)] == ["init", "pin", "evaluated", "dispose"]
    assert not worker_cli.stack.backend_socket().exists() and not worker_cli.stack.warm_socket().exists()
    after = worker_cli.stack.state()
    assert (after.worker_pid, after.warm_pid, after.backend_host_pid, after.deliverer_pid) == (None,) * 4


def test_a_sigkilled_cli_leaves_nothing_that_polls_the_pool(worker_cli: WorkerCli) -> None:
    started = worker_cli.descendants()
    assert _pollers(worker_cli.pool) != [], "the worker polls its pool before the kill"

    os.kill(worker_cli.proc.pid, signal.SIGKILL)
    worker_cli.proc.wait(timeout=30)

    poll_until(lambda: not _gone(started), timeout_s=30, interval_s=0.1,
               what=lambda: f"the CLI's children to die with it; left: {_gone(started)}")
    assert _pollers(worker_cli.pool) == []


def _deployment_on(pool: str) -> str:
    """The eval-point flow deployed on `pool` alone, as `prefect.yaml` deploys it on `pinned-eval`."""
    with get_client(sync_client=True) as c:
        flow_id = c.create_flow_from_name("eval-point")
        pull = [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
        return str(c.create_deployment(flow_id=flow_id, name=pool, work_pool_name=pool, pull_steps=pull,
                                       entrypoint="flows/eval_point.py:eval_point"))


def test_a_point_in_flight_when_the_worker_stops_ends_crashed_with_its_snapshot_retired(
    worker_cli: WorkerCli, tiny_model: Path, tmp_path: Path
) -> None:
    from blocks import ExternalBackendBlock, FleetBlock, StagingBlock

    dead = f"http://127.0.0.1:{free_port()}"  # the external posture never touches the fleet
    env = save_point_blocks(tmp_path, FleetBlock(name=f"d{uuid.uuid4().hex[:6]}", mode="attach",
                                                 engine_urls=[dead], router_url=dead), keep_snapshots=0)
    lifecycle = str(tmp_path / "lifecycle.jsonl")
    ExternalBackendBlock(backend=BACKEND, options={"log": lifecycle, "delay_s": 600.0}).save(f"slow-{env.run}")
    snap = write_step_snapshot(tiny_model, StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, 5))
    params = env.params(5, source={"kind": "staged", "path": snap}, posture="external", backend_block=f"slow-{env.run}")
    with get_client(sync_client=True) as c:
        flow_run_id = c.create_flow_run_from_deployment(_deployment_on(worker_cli.pool), parameters=params).id
    poll_until(lambda: any(e["event"] == "pin" for e in read_lifecycle(lifecycle)), timeout_s=180, interval_s=0.5,
               what=lambda: f"the point to be measuring; CLI log:\n{worker_cli.log.read_text()}")

    os.kill(worker_cli.proc.pid, signal.SIGTERM)
    assert worker_cli.proc.wait(timeout=90) == 0, worker_cli.log.read_text()

    with get_client(sync_client=True) as c:
        state = c.read_flow_run(flow_run_id).state
    assert state is not None and state.type.value == "CRASHED", f"{state}; CLI log:\n{worker_cli.log.read_text()}"
    assert not Path(snap).exists(), "the point's owned snapshot is retired (keep_snapshots=0: deleted)"
    [alert] = settled_events(EVENT_FAILED, point_resource(env.run, 5)["prefect.resource.id"])  # once
    assert alert["payload"]["reason"] == "crashed" and f"prefect.flow-run.{flow_run_id}" in related_flow_runs(alert)
    assert [e["event"] for e in read_lifecycle(lifecycle)] == ["init", "pin", "cancelled", "dispose"]


def test_a_point_measured_through_the_cli_worker_then_a_user_stop_leaves_nothing_running(
    worker_cli: WorkerCli, point_env: PointEnv, tiny_model: Path, tmp_path: Path
) -> None:
    """The new-user walk's last steps: one point measured on the fleet through `pinned-eval worker`
    (its own pool: no other worker can take it), then the user's Ctrl-C-style stop: exit 0, and every
    process it started (by PID) gone, nothing polling the pool.

    Its trackers leave the point's path: W&B (offline files) and MLflow (nothing listens) are sent by
    the worker's deliverer, so the point's state names no MLflow failure, while its ledger rows get
    it afterwards and W&B holds the point's metrics at its step."""
    from blocks import SinksBlock

    SinksBlock(jsonl_path=str(point_env.jsonl), wandb_project="pinned-eval-tests", wandb_mode="offline",
               wandb_dir=str(tmp_path / "wb"), mlflow_tracking_uri=f"http://127.0.0.1:{free_port()}").save(
        point_env.blocks["sinks"], overwrite=True)
    snap = write_step_snapshot(tiny_model, str(tmp_path / "ckpt" / "step_3"))
    params = point_env.params(3, source={"kind": "hf", "path": snap})
    with get_client(sync_client=True) as c:
        flow_run_id = c.create_flow_run_from_deployment(_deployment_on(worker_cli.pool), parameters=params).id
        state = poll_until(lambda: ((s := c.read_flow_run(flow_run_id).state) and s.is_final() and s) or None,
                           timeout_s=240, interval_s=0.5,
                           what=lambda: f"the point to end; CLI log:\n{worker_cli.log.read_text()}")
    assert state.type.value == "COMPLETED", f"{state}; CLI log:\n{worker_cli.log.read_text()}"
    assert "sink failed" not in str(state.message), state.message
    rows = poll_until(lambda: [r for r in JsonlSink(point_env.jsonl).read(point_env.run) if r.step == 3
                               and "mlflow" in r.sink_errors] or None, timeout_s=120, interval_s=0.5,
                      what=lambda: f"the deliverer's MLflow note; CLI log:\n{worker_cli.log.read_text()}")
    assert {(r.state, r.weight_version) for r in rows} == {("measured", "3")}
    assert all(list(r.sink_errors) == ["mlflow"] and r.metrics["eval/sink_failed_mlflow"] == 1.0 for r in rows)
    assert not any(Path(worker_cli.stack.outbox()).glob("*.json")), "the envelope is removed once noted"
    merged = {k: v for r in rows for k, v in r.metrics.items() if not k.startswith("eval/sink_failed_")}
    [logged] = history_rows(tmp_path / "wb")
    assert logged == merged  # every ledger value, exactly, at the point's step
    started = worker_cli.descendants()
    st = worker_cli.stack.state()
    assert {st.worker_pid, st.warm_pid, st.backend_host_pid, st.deliverer_pid} <= {p.pid for p in started}

    os.kill(worker_cli.proc.pid, signal.SIGINT)  # Ctrl-C
    assert worker_cli.proc.wait(timeout=90) == 0, worker_cli.log.read_text()

    assert _gone(started) == [], "every process the CLI started is stopped before it exits"
    assert _pollers(worker_cli.pool) == []
    after = worker_cli.stack.state()
    assert (after.worker_pid, after.warm_pid, after.backend_host_pid, after.deliverer_pid) == (None,) * 4
