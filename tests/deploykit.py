"""A deployed `eval-point` with a real process worker, on the session's Prefect server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from prefect import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter
from prefect.client.schemas.objects import FlowRun

from app.warm_start import SOCKET_ENV, server_command, wait_listening, write_job_template
from pinned_eval.backend_host import HOST_ENV, host_command, wait_host_ready

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Deployed:
    api_url: str
    worker_pid: int
    deployment_id: str
    warm_server_pid: int  # the warm-start fork server the pool's flow runs go through
    backend_host_pid: int  # the backend host the pool's external points use
    backend_socket: Path


def prefect_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )


def without_aws_credentials(env: dict[str, str], empty_dir: Path) -> dict[str, str]:
    """`env` where no AWS variable or file can supply S3 credentials or an endpoint: points get
    them from their staging block only (the CA bundle setting stays)."""
    kept = {k: v for k, v in env.items() if not k.startswith("AWS_") or k == "AWS_CA_BUNDLE"}
    return dict(
        kept,
        AWS_SHARED_CREDENTIALS_FILE=str(empty_dir / "no-aws-credentials"),
        AWS_CONFIG_FILE=str(empty_dir / "no-aws-config"),
        AWS_EC2_METADATA_DISABLED="true",
    )


@pytest.fixture(scope="session")
def deployed(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    env = dict(os.environ, PREFECT_API_URL=prefect_server, PINNED_EVAL_PROJECT_DIR=str(REPO))
    worker_dir = tmp_path_factory.mktemp("worker")
    template = write_job_template(worker_dir / "warm-template.json")
    pool = prefect_cli("work-pool", "create", "pinned-eval", "--type", "process", "--overwrite",
                       "--base-job-template", str(template), env=env)
    assert pool.returncode == 0, pool.stdout + pool.stderr
    dep = prefect_cli("--no-prompt", "deploy", "--all", env=env)
    assert dep.returncode == 0, dep.stdout + dep.stderr
    sock, backend_sock = worker_dir / "warm.sock", worker_dir / "backends.sock"
    worker_env = dict(without_aws_credentials(env, worker_dir), **{SOCKET_ENV: str(sock), HOST_ENV: str(backend_sock)})
    warm_log = open(worker_dir / "warm-start.log", "w")  # noqa: SIM115 - closed at teardown
    warm = subprocess.Popen(server_command(sock), cwd=REPO, env=worker_env, stdout=warm_log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    host_log = open(worker_dir / "backend-host.log", "w")  # noqa: SIM115 - closed at teardown
    host = subprocess.Popen(host_command(backend_sock), cwd=REPO, env=worker_env, stdout=host_log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    wait_listening(sock, warm)
    wait_host_ready(backend_sock)
    log = open(worker_dir / "worker.log", "w")  # noqa: SIM115 - closed at teardown
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", "pinned-eval", "--type", "process"],
        cwd=REPO,
        env=dict(
            worker_env,
            PREFECT_WORKER_QUERY_SECONDS="0.5",
            PREFECT_WORKER_PREFETCH_SECONDS="0.5",
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    with get_client(sync_client=True) as c:
        [d] = c.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["eval-point"])))
    try:
        yield Deployed(prefect_server, worker.pid, str(d.id), warm.pid, host.pid, backend_sock)
    finally:
        for proc in (worker, warm, host):
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        warm_log.close()
        host_log.close()


def runs_of_deployment(deployment_id: str, run: str) -> list[FlowRun]:
    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(deployment_id={"any_": [deployment_id]}))
    return [r for r in runs if r.parameters.get("run") == run]


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


def flow_run_process(worker_pid: int, flow_run_id: str) -> psutil.Process | None:
    """The worker's child process running `flow_run_id` (found by its PREFECT__FLOW_RUN_ID)."""
    for child in psutil.Process(worker_pid).children(recursive=True):
        try:
            if child.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None
