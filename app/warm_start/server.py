"""Fork server of the warm start: imports Prefect and the eval-point flow once, forks a flow run per request.

`python -m app.warm_start.server --socket PATH` (started beside the process worker by
`app.stack.LocalStack.worker_up` / `pinned-eval worker`, stopped by PID with it). It imports
`prefect`, `prefect.engine`, `prefect.flow_engine`, `flows.eval_point` and the installed trackers'
modules (W&B, MLflow, TensorBoard) before listening, with no thread and no event loop started,
then for each connection of the thin client (`app/warm_start/client.py`):

- forks a handler, which forks the flow-run process and reports `pid <N>`;
- the flow-run process takes the client's stdio descriptors, working directory and environment,
  rebuilds Prefect's settings context and logging from that environment, and runs
  `prefect.engine` as `__main__` (what `python -m prefect.engine` runs), then exits through a
  normal interpreter shutdown (atexit hooks flush logs and events);
- the handler waits for the flow-run process and for the client's connection at once: when the
  process ends it sends `exit <code>` / `signal <N>`; when the connection closes first (the
  client was SIGKILLed) it SIGKILLs the flow-run process.

The server reaps its handlers; it exits on SIGTERM/SIGINT and removes its socket.

Local security (`pinned_eval.local_socket`): the socket lives in a 0700 directory of the worker's
own, is mode 0600, and every connection's peer uid is checked (SO_PEERCRED) before anything is
read: another uid's is closed and logged. A stale socket is replaced, a live one refused. The
flow-run process takes from the client's environment only the per-run keys `ENV_ALLOWLIST_*` name
(see `flow_run_env`); everything else, and every key that chooses code, is the server's own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import sys
import threading
from pathlib import Path

from app.warm_start.client import Request, recv_request
from pinned_eval.local_socket import SocketInUse, UnsafeSocketDir, foreign_peer, listen_private

PRELOAD = ("prefect", "prefect.engine", "prefect.flow_engine", "flows.eval_point")

# What a flow run takes from the client's (the worker's) environment: what varies per flow run.
# The process worker passes its own environment plus Prefect's settings, `PREFECT__FLOW_RUN_ID`
# and the attribution keys (`PREFECT__WORKER_*`, `PREFECT__FLOW_*`, `PREFECT__DEPLOYMENT_*`), and
# the deployment's job-variable `env`: the Prefect and pinned-eval keys, and the locale. The fork
# server was started from the worker's environment, so keys that select code or config files
# (PATH, HOME, LD_*, PYTHON*, AWS_CONFIG_FILE, ...) are the server's own: whoever can set a job
# variable or reach the socket cannot make the flow run (or the engines it starts) load other code.
ENV_ALLOWLIST_PREFIXES = ("PREFECT_", "PINNED_EVAL_", "LC_")
ENV_ALLOWLIST_KEYS = frozenset({"LANG", "LANGUAGE", "TZ", "TERM", "COLUMNS", "NO_COLOR"})
# Prefect settings that load code or configuration files: never from the client.
ENV_CODE_KEYS = frozenset(
    {"PREFECT_EXTRA_ENTRYPOINTS", "PREFECT_LOGGING_SETTINGS_PATH", "PREFECT_HOME", "PREFECT_PROFILES_PATH"}
)


def _per_run(key: str) -> bool:
    return (key in ENV_ALLOWLIST_KEYS or key.startswith(ENV_ALLOWLIST_PREFIXES)) and key not in ENV_CODE_KEYS


def flow_run_env(server_env: dict[str, str], client_env: dict[str, str]) -> dict[str, str]:
    """The flow run's environment: the server's own, with the per-run keys (`_per_run`) replaced by
    the client's (a per-run key the client lacks is dropped, as a cold start would not have it)."""
    env = {k: v for k, v in server_env.items() if not _per_run(k)}
    env.update({k: v for k, v in client_env.items() if _per_run(k) and isinstance(v, str)})
    return env


def _preload() -> None:
    """Import `PRELOAD`, then the modules of every installed tracker (W&B, MLflow, TensorBoard:
    `pinned_eval.sinks.extras.TRACKER_MODULES`), so a forked flow run that logs to one does not
    import it again; a tracker that fails to import is one line on stderr and left to the flow run
    (which reports it as that sink's error). No import may start a thread (forking would lose it)."""
    import importlib

    from pinned_eval.sinks.extras import installed_tracker_modules

    for module in PRELOAD:
        importlib.import_module(module)
    for module in installed_tracker_modules():
        try:
            importlib.import_module(module)
        except Exception as exc:  # a broken optional install must not stop the warm start
            print(f"warm start: tracker module {module} not preloaded: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
    if threading.active_count() != 1:
        names = [t.name for t in threading.enumerate()]
        raise RuntimeError(f"importing {PRELOAD} and the trackers started threads {names}: forking would lose them")


def serve(path: Path) -> Request | None:
    """Accept requests until SIGTERM/SIGINT (returns None); in a forked flow-run process, return its request."""
    listener = listen_private(path)
    stop: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _f: stop.append(s))
    print(f"warm start: pid {os.getpid()} listening on {path}", flush=True)
    try:
        while not stop:
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            if not select.select([listener], [], [], 1.0)[0]:
                continue
            conn, _ = listener.accept()
            if (refusal := foreign_peer(conn, f"warm start {path}")) is not None:
                print(refusal, file=sys.stderr, flush=True)
                conn.close()
                continue
            if os.fork() == 0:  # handler; only the flow-run process returns from `_handle`
                listener.close()
                return _handle(conn)
            conn.close()
    finally:
        listener.close()
    path.unlink(missing_ok=True)
    return None


def _handle(conn: socket.socket) -> Request:
    """In the handler: fork the flow-run process (which returns the request), supervise it, `_exit`."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        request, fds = recv_request(conn)
    except EOFError:  # a probe (`wait_listening`): connected, sent nothing
        os._exit(0)
    except (ValueError, OSError) as exc:
        print(f"warm start: bad request: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become_flow_run(request, fds)
        return request
    try:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"pid {pid}\n".encode())
        _supervise(conn, pid)
    finally:
        os._exit(0)


def _supervise(conn: socket.socket, pid: int) -> None:
    pidfd = os.pidfd_open(pid)
    while True:
        ready = select.select([conn.fileno(), pidfd], [], [])[0]
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            message = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
            with contextlib.suppress(OSError):  # the client is gone: nobody to tell
                conn.sendall(f"{message}\n".encode())
            return
        if not conn.recv(1):  # the client is gone (SIGKILLed): take the flow run with it
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return


def _become_flow_run(request: Request, fds: list[int]) -> None:
    """Turn this forked process into the client's flow-run process (stdio, cwd, env, argv, settings)."""
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    env = flow_run_env(dict(os.environ), request["env"])
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["", *request["argv"]]  # runpy sets argv[0]
    import prefect.context
    import prefect.logging.configuration

    prefect.context.refresh_global_settings_context()
    prefect.logging.configuration.setup_logging(incremental=False)


def run_module(module: str) -> None:
    """Run `module` as `__main__`, as `python -m module` does (its exit is the process's)."""
    import runpy

    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.warm_start.server")
    parser.add_argument("--socket", type=Path, required=True, help="Unix socket path to listen on")
    parser.add_argument("--module", default="prefect.engine", help="module each child runs as __main__")
    args = parser.parse_args(argv)
    _preload()
    try:
        request = serve(args.socket)
    except (SocketInUse, UnsafeSocketDir) as exc:
        print(f"warm start: {exc}", file=sys.stderr, flush=True)
        return 2
    if request is None:
        return 0
    run_module(args.module)
    return 0


if __name__ == "__main__":
    sys.exit(main())
