"""Fork server of the warm start: imports Prefect and the eval-point flow once, forks a flow run per request.

`python -m app.warm_start.server --socket PATH` (started beside the process worker by
`app.stack.LocalStack.worker_up` / `pinned-eval worker`, stopped by PID with it). It imports
`prefect`, `prefect.engine`, `prefect.flow_engine` and `flows.eval_point` before listening, with
no thread and no event loop started, then for each connection of the thin client
(`app/warm_start/client.py`):

- forks a handler, which forks the flow-run process and reports `pid <N>`;
- the flow-run process takes the client's stdio descriptors, working directory and environment,
  rebuilds Prefect's settings context and logging from that environment, and runs
  `prefect.engine` as `__main__` (what `python -m prefect.engine` runs), then exits through a
  normal interpreter shutdown (atexit hooks flush logs and events);
- the handler waits for the flow-run process and for the client's connection at once: when the
  process ends it sends `exit <code>` / `signal <N>`; when the connection closes first (the
  client was SIGKILLed) it SIGKILLs the flow-run process.

The server reaps its handlers; it exits on SIGTERM/SIGINT and removes its socket.
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

PRELOAD = ("prefect", "prefect.engine", "prefect.flow_engine", "flows.eval_point")


def _preload() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    if threading.active_count() != 1:
        names = [t.name for t in threading.enumerate()]
        raise RuntimeError(f"importing {PRELOAD} started threads {names}: forking would lose them")


def serve(path: Path) -> Request | None:
    """Accept requests until SIGTERM/SIGINT (returns None); in a forked flow-run process, return its request."""
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
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
    os.environ.clear()
    os.environ.update(request["env"])
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
    if serve(args.socket) is None:
        return 0
    run_module(args.module)
    return 0


if __name__ == "__main__":
    sys.exit(main())
