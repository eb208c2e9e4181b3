"""The local orchestration stack: a Prefect server, the deployments, a process worker, its
warm-start fork server (`app.warm_start`: the pool's flow runs fork from a process that imported
Prefect and the eval-point flow once, instead of starting a fresh interpreter each) and its backend
host (`pinned_eval.backend_host`: external-posture backends built once and reused by every flow run
of the worker, disposed when the host stops).

Whoever starts a process stops it by PID: `LocalStack` records every process it starts in a
state file under its home, so `pinned-eval server down` (or the demo's exit) can stop them from
another process. Nothing binds anything but 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel

from app.prefect_server import ServerProcess, start_server, stop_server
from app.warm_start import SOCKET_ENV, server_command, wait_listening, write_job_template
from pinned_eval.backend_host import HOST_ENV, host_command, wait_host_ready
from pinned_eval.processes import ProcessSpec, free_port, pid_alive, start_process, stop_groups

WORK_POOL = "pinned-eval"
# how often a worker polls for runs (and how far ahead it prefetches): the poll is paid on every
# point between its run's creation and Pending (`python -m bench orchestration`)
WORKER_QUERY_SECONDS = 0.5


def project_dir() -> Path:
    """The directory holding `prefect.yaml`: the working directory or one above it, else the source tree."""
    for d in (Path.cwd(), *Path.cwd().parents):
        if (d / "prefect.yaml").is_file() and (d / "flows" / "eval_point.py").is_file():
            return d
    here = Path(__file__).resolve().parents[1]
    if (here / "prefect.yaml").is_file():
        return here
    raise FileNotFoundError("prefect.yaml not found: run from the pinned-eval project directory")


class StackState(BaseModel):
    server_pid: int | None = None
    api_url: str | None = None
    prefect_home: str | None = None
    worker_pid: int | None = None
    warm_pid: int | None = None
    backend_host_pid: int | None = None


class LocalStack:
    """Server + deployments + worker of one home directory."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.state_file = home / "stack.json"

    def state(self) -> StackState:
        if not self.state_file.exists():
            return StackState()
        return StackState.model_validate_json(self.state_file.read_text())

    def _save(self, state: StackState) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(state.model_dump_json(indent=2))

    def env(self) -> dict[str, str]:
        """Environment for Prefect clients and child processes of this stack."""
        st = self.state()
        if not st.api_url:
            raise RuntimeError(f"no server recorded in {self.state_file}: run `pinned-eval server up`")
        return dict(
            os.environ,
            PREFECT_API_URL=st.api_url,
            PREFECT_HOME=str(st.prefect_home),
            PINNED_EVAL_PROJECT_DIR=str(project_dir()),
            PINNED_EVAL_HOME=str(self.home.resolve()),
        )

    def server_up(self, port: int | None = None) -> ServerProcess:
        """Start the server, or return the one already recorded and healthy."""
        st = self.state()
        if st.api_url and st.server_pid and _healthy(st.api_url):
            return ServerProcess(st.server_pid, st.api_url, Path(str(st.prefect_home)))
        prefect_home = (self.home / "prefect").resolve()
        server = start_server(prefect_home, port if port is not None else _preferred_port())
        self._save(st.model_copy(update={"server_pid": server.pid, "api_url": server.api_url,
                                         "prefect_home": str(prefect_home)}))  # fmt: skip
        return server

    def deploy(self) -> None:
        """Register the block types, create the work pool (warm-start command), deploy `prefect.yaml`."""
        env = self.env()
        self.home.mkdir(parents=True, exist_ok=True)
        template = str(write_job_template(self.home.resolve() / "warm-job-template.json"))
        pool = ["work-pool", "create", WORK_POOL, "--type", "process", "--overwrite", "--base-job-template", template]
        for args in (
            ["block", "register", "-m", "blocks"],
            pool,
            ["--no-prompt", "deploy", "--all"],
        ):
            out = subprocess.run(
                [sys.executable, "-m", "prefect", *args], cwd=project_dir(), env=env,
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            if out.returncode != 0:
                raise RuntimeError(f"prefect {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")

    def warm_socket(self) -> Path:  # in a 0700 directory the companion creates (pinned_eval.local_socket)
        return self.home.resolve() / "sockets" / "warm.sock"

    def backend_socket(self) -> Path:
        return self.home.resolve() / "sockets" / "backends.sock"

    def worker_env(self, query_seconds: float = WORKER_QUERY_SECONDS) -> dict[str, str]:
        """The worker's environment: poll/prefetch interval, the warm-start socket and the backend
        host's socket (both passed on to flow runs)."""
        return dict(self.env(), PREFECT_WORKER_QUERY_SECONDS=str(query_seconds),
                    PREFECT_WORKER_PREFETCH_SECONDS=str(query_seconds),
                    **{SOCKET_ENV: str(self.warm_socket()), HOST_ENV: str(self.backend_socket())})  # fmt: skip

    def backend_host_up(self) -> int:
        """Start the backend host (or return the running one) and wait until it answers."""
        sock = self.backend_socket()
        return self._companion_up("backend-host", "backend_host_pid", sock, host_command(sock),
                                  lambda _proc: wait_host_ready(sock))  # fmt: skip

    def warm_up(self) -> int:
        """Start the warm-start fork server (or return the running one) and wait until it listens."""
        sock = self.warm_socket()
        return self._companion_up("warm-start", "warm_pid", sock, server_command(sock),
                                  lambda proc: wait_listening(sock, proc))  # fmt: skip

    def _companion_up(
        self,
        role: Literal["warm-start", "backend-host"],
        pid_field: Literal["warm_pid", "backend_host_pid"],
        sock: Path,
        command: list[str],
        wait: Callable[[subprocess.Popen[bytes]], object],
    ) -> int:
        """A process beside the worker, serving on `sock` with the worker's environment: the
        recorded one when it is alive and its socket exists, else a new one, recorded, waited for."""
        st = self.state()
        pid = getattr(st, pid_field)
        if pid and pid_alive(pid) and sock.exists():
            return int(pid)
        spec = ProcessSpec(role=role, command=command, env=self.worker_env(), cwd=str(project_dir()))
        record, proc = start_process(spec, self.home / f"{role}.log")
        self._save(st.model_copy(update={pid_field: record.pid}))
        wait(proc)
        return record.pid

    def worker_up(self, *, query_seconds: float = WORKER_QUERY_SECONDS) -> int:
        """Start the fork server and the backend host, then the worker (or return the running worker)."""
        self.warm_up()
        self.backend_host_up()
        st = self.state()
        if st.worker_pid and pid_alive(st.worker_pid):
            return st.worker_pid
        env = self.worker_env(query_seconds)
        spec = ProcessSpec(
            role="worker",
            command=[sys.executable, "-m", "prefect", "worker", "start", "--pool", WORK_POOL, "--type", "process"],
            env=env,
            cwd=str(project_dir()),
        )
        record, _ = start_process(spec, self.home / "worker.log")
        self._save(st.model_copy(update={"worker_pid": record.pid}))
        return record.pid

    def down(self) -> list[str]:
        """Stop the worker, then the server; returns what was stopped."""
        st, stopped = self.state(), []
        if st.worker_pid and pid_alive(st.worker_pid):
            stop_groups([st.worker_pid], grace_s=30)
            stopped.append(f"worker {st.worker_pid}")
        if st.warm_pid and pid_alive(st.warm_pid):
            stop_groups([st.warm_pid], grace_s=30)
            stopped.append(f"warm-start {st.warm_pid}")
        if st.backend_host_pid and pid_alive(st.backend_host_pid):  # SIGTERM: it disposes its backends
            stop_groups([st.backend_host_pid], grace_s=60)
            stopped.append(f"backend-host {st.backend_host_pid}")
        if st.server_pid and pid_alive(st.server_pid):
            stop_server(st.server_pid)
            stopped.append(f"server {st.server_pid}")
        self._save(StackState(prefect_home=st.prefect_home))
        return stopped


def _preferred_port() -> int:
    """4200 (Prefect's usual port) when it is free, else any free port."""

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", 4200))
            return 4200
        except OSError:
            return free_port()


def _healthy(api_url: str) -> bool:
    try:
        return httpx.get(f"{api_url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def describe(stack: LocalStack) -> str:
    return json.dumps(stack.state().model_dump(), indent=2)
