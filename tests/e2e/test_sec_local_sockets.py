"""Local attacks on the worker's Unix sockets (warm-start fork server, backend host), as the
unprivileged neighbour `pe-neighbour`, with the sockets under the world-traversable `shared_dir`:
the private directory keeps the neighbour out, the peer-uid check still does when the permissions
are loosened, unsafe directories and live sockets are refused, stale ones replaced."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.warm_start import CLIENT, SOCKET_ENV, server_command
from pinned_eval.backend_host import evaluate_hosted, host_command, host_health, wait_host_ready
from pinned_eval.external import EvalInput
from pinned_eval.polling import poll_until
from tests.neighbour import SYSTEM_PYTHON, Neighbour, run_as
from tests.pointkit import SMALL_SUITE

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
KINDS = ["warm-start", "backend-host"]

# the neighbour's attack: connect, send a request, report what came back ("closed": refused)
ATTACK = r"""
import json, socket, struct, sys
kind, path = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
try:
    s.connect(path)
except OSError as exc:
    print("connect:", type(exc).__name__); sys.exit(0)
try:
    if kind == "warm-start":  # a flow-run request: run `env` with my environment, on my stdio
        body = json.dumps({"argv": ["env", "LD_PRELOAD"], "env": {"LD_PRELOAD": "/tmp/evil.so"}, "cwd": "/"}).encode()
        socket.send_fds(s, [struct.pack(">I", len(body)) + body], [0, 1, 2])
    else:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: backend-host\r\n\r\n")
    data = s.recv(4096)
except (ConnectionResetError, BrokenPipeError):  # closed before or after our request
    data = b""
print("closed" if not data else "answer: " + data.decode(errors="replace").splitlines()[0])
"""


class Companion:
    """One warm-start fork server or backend host on `sock`, logging to `log` (stop by its group)."""

    def __init__(self, kind: str, sock: Path, log: Path) -> None:
        self.kind, self.sock, self.log = kind, sock, log
        warm = [*server_command(sock), "--module", "tests.warm_child"]
        command = warm if kind == "warm-start" else host_command(sock)
        with open(log, "a") as out:
            self.proc = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def exit_or_listen(self) -> int | None:
        """Wait until the process exits (its exit code) or accepts connections on its socket (None)."""

        def settled() -> tuple[int | None] | None:
            if (rc := self.proc.poll()) is not None:
                return (rc,)
            return (None,) if _accepts(self.sock) else None

        return poll_until(settled, timeout_s=120, what=f"{self.kind} to exit or listen on {self.sock}")[0]

    def wait_ready(self) -> None:
        assert self.exit_or_listen() is None, self.log.read_text()
        if self.kind == "backend-host":
            wait_host_ready(self.sock)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _accepts(sock: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(sock))
        except OSError:
            return False
        return True


@pytest.fixture
def companions(tmp_path: Path) -> Iterator[list[Companion]]:
    started: list[Companion] = []
    yield started
    for c in started:
        c.stop()


def _start(companions: list[Companion], kind: str, sock: Path, tmp_path: Path) -> Companion:
    c = Companion(kind, sock, tmp_path / f"{kind}-{len(companions)}.log")
    companions.append(c)
    return c


@pytest.mark.parametrize("kind", KINDS)
def test_the_neighbour_cannot_reach_a_socket_placed_under_a_shared_dir(
    kind: str, neighbour: Neighbour, shared_dir: Path, companions: list[Companion], tmp_path: Path
) -> None:
    sock = shared_dir / "worker" / f"{kind}.sock"  # the directory does not exist yet: the server makes it
    _start(companions, kind, sock, tmp_path).wait_ready()
    d, s = os.lstat(sock.parent), os.lstat(sock)
    assert (stat.S_IMODE(d.st_mode), d.st_uid) == (0o700, os.geteuid())
    assert (stat.S_IMODE(s.st_mode), s.st_uid) == (0o600, os.geteuid())
    attack = run_as(neighbour, ATTACK, kind, str(sock))
    assert attack.stdout.strip() == "connect: PermissionError", attack.stdout + attack.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_the_peer_check_refuses_the_neighbour_when_permissions_are_loosened(
    kind: str, neighbour: Neighbour, shared_dir: Path, companions: list[Companion], tmp_path: Path
) -> None:
    private = shared_dir / "worker"
    private.mkdir(mode=0o700)
    sock = private / f"{kind}.sock"
    server = _start(companions, kind, sock, tmp_path)
    server.wait_ready()
    private.chmod(0o755)  # an operator's chmod, an ACL: the file system no longer keeps anyone out
    sock.chmod(0o666)
    attack = run_as(neighbour, ATTACK, kind, str(sock))
    assert attack.stdout.strip() == "closed", attack.stdout + attack.stderr
    refused = f"refused a connection from uid {neighbour.uid} "
    poll_until(lambda: refused in server.log.read_text(), timeout_s=30, what=f"{refused!r} in the server's log")
    assert _accepts(sock), "the owner still gets in"
    if kind == "backend-host":  # whose client refuses a loosened directory (UnsafeSocketDir) until it is private again
        with pytest.raises(RuntimeError, match=f"socket directory {private}: mode 0755 lets group/others in"):
            host_health(sock)
        private.chmod(0o700)
        assert host_health(sock)["pid"] == server.proc.pid


def _loose(d: Path, _who: Neighbour) -> None:
    d.mkdir(mode=0o700)
    d.chmod(0o755)  # what `mkdir -p` under the usual umask 022 makes


def _symlink(d: Path, _who: Neighbour) -> None:
    target = d.with_name("elsewhere")
    target.mkdir(mode=0o700)
    d.symlink_to(target)


def _foreign(d: Path, who: Neighbour) -> None:
    d.mkdir(mode=0o700)
    os.chown(d, who.uid, who.gid)


@pytest.mark.parametrize(
    ("prepare", "problem"),
    [(_loose, "mode 0755 lets group/others in"), (_symlink, "is a symlink"), (_foreign, "owned by uid")],
    ids=["group-other-access", "symlink", "other-owner"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_an_unsafe_socket_directory_is_refused(
    kind: str, prepare: Callable[[Path, Neighbour], None], problem: str, neighbour: Neighbour, shared_dir: Path,
    companions: list[Companion], tmp_path: Path,
) -> None:
    d = shared_dir / "worker"
    prepare(d, neighbour)
    server = _start(companions, kind, d / f"{kind}.sock", tmp_path)
    code = server.exit_or_listen()
    assert code in (1, 2), f"it must refuse to start, got {code}: {server.log.read_text()}"
    assert f"socket directory {d}: {problem}" in server.log.read_text()
    assert not (d / f"{kind}.sock").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_stale_socket_is_replaced_a_live_one_refused(
    kind: str, shared_dir: Path, companions: list[Companion], tmp_path: Path
) -> None:
    private = shared_dir / "worker"
    private.mkdir(mode=0o700)
    sock = private / f"{kind}.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:  # a crashed server's leftover
        dead.bind(str(sock))
    first = _start(companions, kind, sock, tmp_path)
    first.wait_ready()
    inode = os.lstat(sock).st_ino
    second = _start(companions, kind, sock, tmp_path)
    exited = poll_until(lambda: second.proc.poll() is not None or os.lstat(sock).st_ino != inode, timeout_s=120,
                        what="the second server to exit or take the socket")
    assert exited and os.lstat(sock).st_ino == inode, "a second server on a live socket must not take it"
    assert second.proc.returncode in (1, 2)
    assert f"socket path {sock}: a server is already listening there" in second.log.read_text()
    assert first.proc.poll() is None and _accepts(sock), "the live server keeps its socket"
    if kind == "backend-host":
        assert host_health(sock)["pid"] == first.proc.pid


# the neighbour squats a socket path the worker's clients are configured with, and keeps what it receives
SQUAT = r"""
import os, socket, sys
path, out = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
os.chmod(path, 0o777)
s.listen(1)
print("ready", flush=True)
conn, _ = s.accept()
conn.settimeout(30)
data = b""
try:
    while chunk := conn.recv(65536):
        data += chunk
        if len(data) > 200:
            break
except OSError:
    pass
open(out, "wb").write(data)
"""


class Squatter:
    def __init__(self, who: Neighbour, sock: Path) -> None:
        self.out = sock.with_suffix(".got")
        self.proc = subprocess.Popen([SYSTEM_PYTHON, "-c", SQUAT, str(sock), str(self.out)], user=who.uid,
                                     group=who.gid, extra_groups=[], env={"PATH": "/usr/bin:/bin"}, cwd="/",
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def received(self) -> bytes:
        self.proc.wait(timeout=60)
        return self.out.read_bytes() if self.out.exists() else b""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def test_the_warm_start_client_never_talks_to_a_squatted_socket(neighbour: Neighbour, shared_dir: Path) -> None:
    sock = shared_dir / "warm.sock"
    squatter = Squatter(neighbour, sock)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update({SOCKET_ENV: str(sock), "PREFECT_API_AUTH_STRING": "admin:the-secret"})
        done = subprocess.run([sys.executable, "-S", str(CLIENT), "not-a-flow-run-id"], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        got = squatter.received()
    finally:
        squatter.stop()
    assert got == b"", f"the squatter received {got[:80]!r}"
    assert f"the server at {sock} runs as uid {neighbour.uid}" in done.stderr, done.stderr
    assert "cold start (python -m prefect.engine)" in done.stderr


def test_the_backend_host_client_never_talks_to_a_squatted_socket(neighbour: Neighbour, shared_dir: Path) -> None:
    sock = shared_dir / "backends.sock"
    squatter = Squatter(neighbour, sock)
    inp = EvalInput(run="exp42", step=1, hf_dir="/s", suite=SMALL_SUITE)
    try:  # `UnsafeSocketDir`, before anything is sent
        with pytest.raises(RuntimeError, match=rf"socket directory {shared_dir}: mode 1777"):  # UnsafeSocketDir
            evaluate_hosted(sock, "tests.hosted_backends:LifecycleBackend", {"api_key": "the-secret"}, "/s", inp)
    finally:
        squatter.stop()
    assert not squatter.out.exists(), "the squatter was never connected to"
