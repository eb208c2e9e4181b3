"""The warm start's thin client and fork server over a real Unix socket (`tests/warm_child.py` stands
in for `prefect.engine`), and the client's cold-start fallback to the real `python -m prefect.engine`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from app.warm_start import CLIENT, pool_command
from app.warm_start.client import SOCKET_ENV

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    sock = tmp_path_factory.mktemp("warm") / "warm.sock"
    log = sock.with_name("server.log")
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "app.warm_start.server", "--socket", str(sock), "--module", "tests.warm_child"],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"fork server did not listen (rc={server.poll()}):\n{log.read_text()}")
            time.sleep(0.1)
        yield sock
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    assert not sock.exists(), "the server removes its socket on SIGTERM"


def client(args: list[str], env: dict[str, str], cwd: Path, **kw) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    return subprocess.Popen(
        [sys.executable, "-S", str(CLIENT), *args], env=env, cwd=cwd, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw,
    )


def test_client_passes_stdio_cwd_env_argv_and_exit_status(fork_server: Path, tmp_path: Path) -> None:
    env = dict(os.environ, **{SOCKET_ENV: str(fork_server)}, PINNED_EVAL_PROBE="probe-1")
    out, err = client(["report", "x"], env, tmp_path).communicate("from-stdin\n", timeout=60)
    assert out.strip() == f"cwd={tmp_path} argv=['report', 'x'] probe=probe-1 stdin=from-stdin"
    assert err.strip() == "to-stderr"
    proc = client(["exit", "7"], env, tmp_path)
    proc.communicate(timeout=60)
    assert proc.returncode == 7


def _started(proc: subprocess.Popen[str]) -> psutil.Process:
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:1] == ["ready"], line
    return psutil.Process(int(line[1]))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_client_forwards_signals_and_dies_of_the_childs_signal(fork_server: Path, tmp_path: Path, signum: int) -> None:
    proc = client(["sleep"], dict(os.environ, **{SOCKET_ENV: str(fork_server)}), tmp_path)
    child = _started(proc)
    assert child.pid != proc.pid and child.ppid() != proc.pid  # a fork of the server, not of the client
    proc.send_signal(signum)
    proc.communicate(timeout=60)
    # SIGTERM: default disposition; SIGINT: an uncaught KeyboardInterrupt re-raises SIGINT at exit
    assert proc.returncode == -signum
    assert child.wait(timeout=30) is None or not child.is_running()


def test_sigkilled_client_takes_the_child_with_it(fork_server: Path, tmp_path: Path) -> None:
    proc = client(["sleep"], dict(os.environ, **{SOCKET_ENV: str(fork_server)}), tmp_path)
    child = _started(proc)
    proc.kill()
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs([child], timeout=30)
    assert gone and not alive


def test_server_survives_a_malformed_request(fork_server: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(fork_server))
        s.sendall(b"\x00\x00\x00\x02{}")  # no descriptors, no fields
        assert s.recv(100) == b""  # the handler drops it
    proc = client(["exit", "3"], dict(os.environ, **{SOCKET_ENV: str(fork_server)}), tmp_path)
    proc.communicate(timeout=60)
    assert proc.returncode == 3


@pytest.mark.parametrize("socket_env", [None, "missing.sock"])
def test_without_a_server_the_client_cold_starts_prefect_engine(tmp_path: Path, socket_env: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    if socket_env:
        env[SOCKET_ENV] = str(tmp_path / socket_env)
    proc = client(["not-a-flow-run-id"], env, tmp_path)
    pid = proc.pid
    _, err = proc.communicate(timeout=120)
    assert "cold start (python -m prefect.engine)" in err
    assert "Invalid flow run id" in err, err  # the real engine ran, in the client's own process
    assert proc.returncode == 1 and proc.pid == pid


def test_client_imports_only_the_standard_library() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(CLIENT.parent)!r}); import client; "
        "print(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names) - {'client', '__main__'}))"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
    assert pool_command("/py").split() == ["/py", "-S", str(CLIENT)]


def test_wait_listening_names_a_server_that_exits_or_never_listens(tmp_path: Path) -> None:
    from app.warm_start import wait_listening

    sock = tmp_path / "warm.sock"
    exited = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(RuntimeError, match=f"^warm-start server exited with 3 before listening on {sock}$"):
        wait_listening(sock, exited, timeout_s=60)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RuntimeError, match=rf"^warm-start server on {sock} \(after 0.3s\)$"):
            wait_listening(sock, idle, timeout_s=0.3)
    finally:
        idle.kill()
        idle.wait()


def test_a_forked_flow_run_finds_the_installed_trackers_already_imported(fork_server: Path, tmp_path: Path) -> None:
    from pinned_eval.sinks.extras import TRACKER_MODULES, installed_tracker_modules

    every = [m for modules in TRACKER_MODULES.values() for m in modules]
    assert installed_tracker_modules() == every, "the dev venv has every tracker extra"
    env = dict(os.environ, **{SOCKET_ENV: str(fork_server)})
    out, err = client(["modules", *every, "prefect.engine", "not_a_module"], env, tmp_path).communicate(timeout=60)
    assert json.loads(out) == [*every, "prefect.engine"], err


def test_a_tracker_that_fails_to_import_is_one_line_and_the_server_still_preloads() -> None:
    code = ("from pinned_eval.sinks import extras; import sys\n"
            "extras.TRACKER_MODULES['tensorboard'] = ('tensorboard.no_such_module', 'numpy')\n"
            "from app.warm_start import server; server._preload()\n"
            "print('tensorboard.no_such_module' in sys.modules, 'numpy' in sys.modules, 'mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "False True True\n"
    assert out.stderr == ("warm start: tracker module tensorboard.no_such_module not preloaded: "
                          "ModuleNotFoundError: No module named 'tensorboard.no_such_module'\n")
