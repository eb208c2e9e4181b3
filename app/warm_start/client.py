"""Thin client of the warm start: the process worker's `command` for a flow run (stdlib only).

Run as `python -S <this file> [flow-run-id]`: it starts in tens of milliseconds because it imports
nothing but the standard library. It hands its argv, environment, working directory and stdio
descriptors to the fork server on the Unix socket named by `PINNED_EVAL_WARM_SOCKET`, which forks
a child that runs the flow run as `python -m prefect.engine` would. The client forwards SIGTERM
and SIGINT to that child and exits with its status (a signal death is re-raised, so the worker
sees the same return code as for a cold process). If the client is SIGKILLed the server kills
the child (it watches this connection). With no server listening, or one of another uid (checked
with SO_PEERCRED before anything is sent), it `exec`s `python -m prefect.engine` itself (cold
start) and says so on stderr.

Wire format. Client → server, once: a 4-byte big-endian length, then a JSON `Request` (argv,
env, cwd); the first `sendmsg` carries stdin/stdout/stderr as SCM_RIGHTS descriptors.
Server → client, lines: `pid <N>` once the child is forked, then `exit <code>` or `signal <N>`
when it ends. A connection closed before that means the server died: exit 1.
"""


from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
from typing import TypedDict

SOCKET_ENV = "PINNED_EVAL_WARM_SOCKET"
MAX_REQUEST_BYTES = 4 * 1024 * 1024
_HEADER = struct.Struct(">I")


class Request(TypedDict):
    argv: list[str]
    env: dict[str, str]
    cwd: str


def send_request(sock: socket.socket, request: Request, fds: list[int]) -> None:
    body = json.dumps(request).encode()
    data = _HEADER.pack(len(body)) + body
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_request(sock: socket.socket) -> tuple[Request, list[int]]:
    """Read one request and its descriptors; `ValueError` on a malformed or oversized one, `EOFError`
    when the peer closed without sending anything (a liveness probe)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 3)
    if not data and not fds:
        raise EOFError("request: connection closed before a request")
    if len(data) < _HEADER.size:
        raise ValueError("request: truncated header")
    (size,) = _HEADER.unpack_from(data)
    if size > MAX_REQUEST_BYTES:
        raise ValueError(f"request: {size} bytes exceeds {MAX_REQUEST_BYTES}")
    body = bytearray(data[_HEADER.size :])
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            raise ValueError("request: connection closed mid-body")
        body += chunk
    request = json.loads(bytes(body))
    for field, kind in (("argv", list), ("env", dict), ("cwd", str)):
        if not isinstance(request.get(field), kind):
            raise ValueError(f"request: field {field!r} must be a {kind.__name__}")
    if len(fds) != 3:
        raise ValueError(f"request: expected 3 file descriptors (stdio), got {len(fds)}")
    return request, fds


def _cold_start(reason: str) -> None:
    """Replace this process with `python -m prefect.engine` (same PID, so the worker still tracks it)."""
    print(f"pinned-eval warm start: {reason}; cold start (python -m prefect.engine)", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "prefect.engine", *sys.argv[1:]])


def _exit_like(status: str) -> int:
    kind, _, value = status.partition(" ")
    if kind == "exit":
        return int(value)
    if kind == "signal":
        signum = int(value)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die of the same signal, as the child did
        return 128 + signum
    print(f"pinned-eval warm start: unexpected status {status!r} from the fork server", file=sys.stderr)
    return 1


def main() -> int:
    path = os.environ.get(SOCKET_ENV)
    if not path:
        _cold_start(f"{SOCKET_ENV} is not set")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        _cold_start(f"no fork server at {path} ({exc.strerror or exc})")
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.geteuid():  # someone else's socket: it would get our environment (API credentials)
        sock.close()
        _cold_start(f"the server at {path} runs as uid {uid}, not as this uid {os.geteuid()}")
    child: list[int] = []
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if child:
            with contextlib.suppress(ProcessLookupError):  # it ended; its status is on the way
                os.kill(child[0], signum)
        else:
            pending.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    send_request(sock, Request(argv=sys.argv[1:], env=dict(os.environ), cwd=os.getcwd()), [0, 1, 2])
    lines = sock.makefile("r", encoding="ascii")
    for line in lines:
        kind, _, value = line.strip().partition(" ")
        if kind == "pid":
            child.append(int(value))
            for queued in pending:
                os.kill(child[0], queued)
        else:
            return _exit_like(line.strip())
    print("pinned-eval warm start: the fork server closed the connection", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
