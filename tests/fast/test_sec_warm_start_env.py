"""The warm start's flow-run process takes from the client only the per-run environment keys: a
client (or a job variable the worker passes on) cannot make it load other code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from app.warm_start import CLIENT, server_command, wait_listening
from app.warm_start.client import SOCKET_ENV

REPO = Path(__file__).resolve().parents[2]
KEYS = ["LD_PRELOAD", "PYTHONPATH", "PATH", "PREFECT_EXTRA_ENTRYPOINTS", "PREFECT__FLOW_RUN_ID", "PINNED_EVAL_PROBE",
        "PINNED_EVAL_SERVER_ONLY", "LANG"]


def test_only_allowlisted_keys_of_the_clients_environment_reach_the_flow_run(tmp_path: Path) -> None:
    sock = tmp_path / "sockets" / "warm.sock"
    sock.parent.mkdir(mode=0o700)
    base = {k: v for k, v in os.environ.items() if k not in KEYS and not k.startswith(("PREFECT_", "PINNED_EVAL_"))}
    server_env = dict(base, PYTHONPATH=str(REPO), PATH="/usr/bin:/bin", PINNED_EVAL_SERVER_ONLY="server")
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen([*server_command(sock), "--module", "tests.warm_child"], cwd=REPO, env=server_env,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_listening(sock, server)
        client_env = dict(
            base, **{SOCKET_ENV: str(sock)}, LD_PRELOAD="/nonexistent/evil.so", PYTHONPATH="/nonexistent/evil",
            PATH=f"/nonexistent/bin:{os.environ['PATH']}", PREFECT_EXTRA_ENTRYPOINTS="evil_module",
            PREFECT__FLOW_RUN_ID="run-1", PINNED_EVAL_PROBE="per-run", LANG="C.UTF-8",
        )
        done = subprocess.run([sys.executable, "-S", str(CLIENT), "env", *KEYS], env=client_env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "LD_PRELOAD": None,  # code-selecting keys are the server's own
        "PYTHONPATH": str(REPO),
        "PATH": "/usr/bin:/bin",
        "PREFECT_EXTRA_ENTRYPOINTS": None,  # a Prefect setting that imports modules: never from the client
        "PREFECT__FLOW_RUN_ID": "run-1",  # the per-run keys are the client's
        "PINNED_EVAL_PROBE": "per-run",
        "PINNED_EVAL_SERVER_ONLY": None,
        "LANG": "C.UTF-8",
    }
