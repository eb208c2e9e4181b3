"""Warm start of flow-run processes: a fork server beside the process worker and its thin client.

Opt-in per work pool: `warm_job_template()` is a process pool's base job template whose `command`
(`pool_command()`) runs each flow run through the thin client, and the worker's environment names
the server's socket (`SOCKET_ENV`, which the worker passes on to the client). Without a listening
server the client cold-starts `python -m prefect.engine`, so nothing breaks, it is just slower.
`start_server` / `wait_listening` start it beside a worker; stop it by PID (SIGTERM) with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from app.warm_start.client import SOCKET_ENV
from pinned_eval.local_socket import answers
from pinned_eval.polling import PollTimeout, poll_until

CLIENT = Path(__file__).with_name("client.py")

__all__ = ["CLIENT", "SOCKET_ENV", "pool_command", "server_command", "wait_listening", "warm_job_template"]


def pool_command(python: str = sys.executable) -> str:
    """The process worker's `command` for a warm-started flow run (absolute, so any cwd works)."""
    return f"{python} -S {CLIENT}"


def server_command(socket_path: Path, python: str = sys.executable) -> list[str]:
    """Command line of the fork server (run it from the project directory, which must be importable)."""
    return [python, "-m", "app.warm_start.server", "--socket", str(socket_path)]


def warm_job_template() -> dict[str, Any]:
    """The process worker's default base job template with `command` defaulting to `pool_command()`."""
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    template["variables"]["properties"]["command"]["default"] = pool_command()
    return template


def write_job_template(path: Path) -> Path:
    """`warm_job_template()` as JSON at `path`, for `prefect work-pool create --base-job-template`."""
    path.write_text(json.dumps(warm_job_template()))
    return path


def wait_listening(socket_path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    """Block until the server accepts connections on `socket_path`; `RuntimeError` if it exits or
    times out first."""

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"warm-start server exited with {proc.returncode} before listening on {socket_path}")
        return answers(socket_path)

    try:
        poll_until(listening, timeout_s=timeout_s, interval_s=0.05, what=f"warm-start server on {socket_path}")
    except PollTimeout as exc:
        raise RuntimeError(str(exc)) from None
