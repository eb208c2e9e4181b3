"""Escapes tried by model-written code in the bwrap sandbox, and by a second local user against it.

Each attack is its own test and must be refused; after each, nothing of the run is left (its pid
namespace is empty and no process of the sandbox user runs). The neighbour (`pe-neighbour`,
tests/neighbour.py) attacks a running sandbox from the host with the system Python.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pinned_eval.polling import poll_until
from pinned_eval.sandbox import (
    BwrapSandbox,
    Outcome,
    RunResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    create_sandbox,
)
from pinned_eval.sandbox.base import namespace_members
from pinned_eval.sandbox.bwrap import WORK
from tests.neighbour import Neighbour, run_as
from tests.sandboxkit import assert_nothing_left, require_bwrap, sandbox_uid_processes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sandbox() -> BwrapSandbox:
    return require_bwrap()

ATTEMPT = """
import errno, os, sys
def attempt(label, action):
    try:
        action()
        print(label, "ok")
    except OSError as exc:
        print(label, errno.errorcode.get(exc.errno, type(exc).__name__))
"""


def test_code_cannot_connect_to_a_port_the_worker_listens_on(sandbox: BwrapSandbox) -> None:
    """A stand-in for the Prefect API on 127.0.0.1 (and an abstract unix socket, which a network
    namespace also separates): the code's connects are refused and nothing arrives."""
    abstract = f"\0pe-sandbox-test-{uuid.uuid4().hex}"
    with socket.socket() as api, socket.socket(socket.AF_UNIX) as local:
        api.bind(("127.0.0.1", 0))
        api.listen(8)
        local.bind(abstract)
        local.listen(8)
        port = api.getsockname()[1]
        code = ATTEMPT + (
            "import socket\n"
            f"attempt('tcp', lambda: socket.create_connection(('127.0.0.1', {port}), timeout=5).close())\n"
            f"attempt('tcp-any', lambda: socket.create_connection(('0.0.0.0', {port}), timeout=5).close())\n"
            "attempt('outside', lambda: socket.create_connection(('192.0.2.1', 80), timeout=5).close())\n"
            f"attempt('abstract', lambda: socket.socket(socket.AF_UNIX).connect({abstract!r}))\n"
            "print([name for _, name in socket.if_nameindex()])\n"
        )
        result = sandbox.run(code)
        assert result.outcome is Outcome.OK, result.stderr
        assert result.stdout.splitlines() == ["tcp ECONNREFUSED", "tcp-any ECONNREFUSED", "outside ENETUNREACH",
                                              "abstract ECONNREFUSED", "['lo']"]
        for listener in (api, local):
            listener.setblocking(False)
            with pytest.raises(BlockingIOError):
                listener.accept()  # nothing connected to the worker's sockets
    assert_nothing_left(result)


def test_code_cannot_read_the_workers_home_credential_or_checkout(sandbox: BwrapSandbox) -> None:
    home_dir = Path.home() / ".config" / f"pe-sandbox-test-{uuid.uuid4().hex}"
    home_dir.mkdir(parents=True)
    secret = home_dir / "api-auth"
    secret.write_text("credential-that-must-not-leak")
    secret.chmod(0o644)  # even a world-readable file: the home is not there at all
    try:
        code = ATTEMPT + (
            f"attempt('credential', lambda: print(open({str(secret)!r}).read()))\n"
            f"attempt('home', lambda: print(os.listdir({str(Path.home())!r})))\n"
            f"attempt('checkout', lambda: print(open({str(REPO / 'pyproject.toml')!r}).read()[:10]))\n"
            "attempt('passwd', lambda: print(open('/etc/passwd').read()[:10]))\n"
            "print(sorted(os.listdir('/')), os.listdir('/etc'))\n"
            "print(os.getuid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        )
        result = sandbox.run(code)
    finally:
        secret.unlink()
        home_dir.rmdir()
    assert result.outcome is Outcome.OK, result.stderr
    top = sorted({"usr", "proc", "dev", "etc", "work"} | {p for p in ("bin", "lib", "lib64", "sbin")
                                                          if os.path.lexists(f"/{p}")})
    assert result.stdout.splitlines() == [
        "credential ENOENT", "home ENOENT", "checkout ENOENT", "passwd ENOENT",
        f"{top} ['ld.so.cache']",
        "65534 [1]",  # nobody inside; its /proc shows itself only (its namespace's pid 1)
    ]
    assert "credential-that-must-not-leak" not in result.stdout + result.stderr
    assert_nothing_left(result)


def test_code_cannot_write_outside_the_work_dir(sandbox: BwrapSandbox, shared_dir: Path) -> None:
    """Read-only system dirs, no /tmp, no host paths; even a 1777 host directory is not there."""
    targets = ["/", "/usr", "/etc", "/dev", "/dev/shm", "/proc", "/tmp", str(shared_dir), WORK]
    code = ATTEMPT + "".join(
        f"attempt({t!r}, lambda: open(os.path.join({t!r}, 'pwned'), 'w').write('x'))\n" for t in targets
    ) + "attempt('mkdir', lambda: os.mkdir('/pwned'))\n"
    result = sandbox.run(code)
    assert result.outcome is Outcome.OK, result.stderr
    assert result.stdout.splitlines() == [
        "/ EROFS", "/usr EROFS", "/etc EROFS", "/dev EROFS", "/dev/shm EROFS", "/proc ENOENT", "/tmp ENOENT",
        f"{shared_dir} ENOENT", f"{WORK} ok", "mkdir EROFS",
    ]
    assert list(shared_dir.iterdir()) == []
    assert_nothing_left(result)


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing(sandbox: BwrapSandbox) -> None:
    code = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(600)\n"
        "            os._exit(0)\n"
        "        children += 1\n"
        "except OSError as exc:\n"
        "    print(children, exc.errno)\n"
    )
    result = sandbox.run(code, limits=SandboxLimits(processes=16))
    assert result.outcome is Outcome.OK, result.stderr
    if os.geteuid() == 0:
        # the sandbox uid holds bwrap and the program: 14 forks, then EAGAIN
        assert result.stdout == "14 11\n"
    else:
        assert result.stdout.endswith(" 11\n")
    assert_nothing_left(result)  # the 14 sleepers died with the namespace


def test_a_memory_blow_up_gets_memory_error(sandbox: BwrapSandbox) -> None:
    code = "a = bytearray(64 << 20)\nprint('64 MiB ok', flush=True)\nb = bytearray(2 << 30)\nprint('2 GiB ok')\n"
    result = sandbox.run(code, limits=SandboxLimits(memory_mb=256))
    assert result.outcome is Outcome.MEMORY
    assert result.stdout == "64 MiB ok\n"
    assert result.stderr.splitlines()[-1] == "MemoryError"
    assert_nothing_left(result)


def test_a_busy_loop_is_stopped_by_the_cpu_limit(sandbox: BwrapSandbox) -> None:
    """The program is its namespace's pid 1, which ignores SIGXCPU: the hard limit's SIGKILL ends it."""
    result = sandbox.run("while True:\n    pass\n", limits=SandboxLimits(cpu_s=1, wall_s=120))
    assert (result.outcome, result.exit_code) == (Outcome.CPU, 128 + signal.SIGKILL)
    assert result.cpu_s >= 1.0
    assert_nothing_left(result)


def test_a_busy_child_gets_sigxcpu(sandbox: BwrapSandbox) -> None:
    code = ("import os, sys\npid = os.fork()\nif pid == 0:\n    while True:\n        pass\n"
            "sys.exit(os.waitpid(pid, 0)[1])\n")
    result = sandbox.run(code, limits=SandboxLimits(cpu_s=1, wall_s=120))
    assert (result.outcome, result.stderr) == (Outcome.ERROR, "")
    assert result.exit_code == signal.SIGXCPU  # the child's wait status, passed on by the program
    assert_nothing_left(result)


def test_a_sleeper_and_its_children_are_killed_at_the_wall_deadline(sandbox: BwrapSandbox) -> None:
    code = ("import os, time\nos.fork()\nos.setsid() if os.fork() == 0 else None\nprint('up', flush=True)\n"
            "time.sleep(600)\n")
    result = sandbox.run(code, limits=SandboxLimits(wall_s=1))
    assert (result.outcome, result.exit_code) == (Outcome.TIMEOUT, -signal.SIGKILL)
    assert result.stdout.count("up\n") == 4
    assert_nothing_left(result)


def test_an_output_flood_is_cut_at_the_cap_and_killed(sandbox: BwrapSandbox) -> None:
    result = sandbox.run("while True:\n    print('x' * 999)\n", limits=SandboxLimits(output_bytes=10_000))
    assert (result.outcome, result.truncated) == (Outcome.OUTPUT_LIMIT, True)
    assert result.stdout == ("x" * 999 + "\n") * 10
    assert_nothing_left(result)


NEIGHBOUR_ATTACK = ATTEMPT + """
import ctypes, signal
bwrap, pid = int(sys.argv[1]), int(sys.argv[2])
attempt("read", lambda: open(f"/proc/{pid}/root/work/secret").read())
attempt("read-cwd", lambda: open(f"/proc/{pid}/cwd/secret").read())
attempt("list", lambda: os.listdir(f"/proc/{pid}/root/work"))
attempt("write", lambda: open(f"/proc/{pid}/root/work/evil", "w").write("x"))
attempt("environ", lambda: open(f"/proc/{pid}/environ").read())
attempt("kill", lambda: os.kill(pid, signal.SIGKILL))
attempt("kill-bwrap", lambda: os.kill(bwrap, signal.SIGKILL))
libc = ctypes.CDLL(None, use_errno=True)
def ptrace():
    if libc.ptrace(16, pid, 0, 0) != 0:  # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), "ptrace")
attempt("ptrace", ptrace)
"""


def test_the_neighbour_cannot_read_write_signal_or_ptrace_a_running_sandbox(
    sandbox: BwrapSandbox, neighbour: Neighbour
) -> None:
    code = (
        "import os, signal\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
        "open('secret', 'w').write('s3cret')\n"
        "open('ready', 'w').close()\n"
        "signal.sigwait({signal.SIGUSR1})\n"
        "print(sorted(os.listdir('.')), open('secret').read())\n"
    )
    running = sandbox.start(code, limits=SandboxLimits(wall_s=60))
    try:
        program = running.child_pid
        assert program is not None
        poll_until(lambda: Path(f"/proc/{program}/root{WORK}/ready").exists(), timeout_s=30,
                   what="the sandbox to write its secret")
        attack = run_as(neighbour, NEIGHBOUR_ATTACK, str(running.popen.pid), str(program))
        os.kill(program, signal.SIGUSR1)  # the worker (root) releases the run
        result = running.wait()
    finally:
        running.kill()
        running.wait()
    assert attack.stdout.splitlines() == [
        "read EACCES", "read-cwd EACCES", "list EACCES", "write EACCES", "environ EACCES",
        "kill EPERM", "kill-bwrap EPERM", "ptrace EPERM",
    ], attack.stderr
    assert result.outcome is Outcome.OK, result.stderr
    assert result.stdout == "['main.py', 'ready', 'secret'] s3cret\n"
    assert_nothing_left(result)


def test_a_sigkilled_worker_leaves_no_sandbox_running(sandbox: BwrapSandbox) -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c",
         "from pinned_eval.sandbox import create_sandbox, SandboxLimits\n"
         "run = create_sandbox().start('import os, time\\nos.fork()\\ntime.sleep(600)',\n"
         "                             limits=SandboxLimits(wall_s=600))\n"
         "print(run.pid_namespace, flush=True)\n"
         "run.wait()\n"],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert worker.stdout is not None
    pid_ns = int(worker.stdout.readline())
    poll_until(lambda: len(namespace_members(pid_ns)) == 2, timeout_s=30, what="the program and its child running")
    worker.kill()
    worker.wait()
    poll_until(lambda: namespace_members(pid_ns) == [], timeout_s=30, what=f"pid namespace {pid_ns} to empty")
    poll_until(lambda: sandbox_uid_processes() == [], timeout_s=30, what="no process of the sandbox user")


def test_files_are_copied_into_the_work_dir_and_paths_outside_it_are_refused(sandbox: BwrapSandbox) -> None:
    result = sandbox.run(
        "import os, sys\nprint(open('data/in.txt').read(), open('b.bin', 'rb').read(), sys.stdin.read())\n"
        "print(oct(os.stat('data/in.txt').st_mode & 0o777))",
        files={"data/in.txt": "hello", "b.bin": b"\x00\x01"}, stdin=b"from stdin",
    )
    assert result.stdout == "hello b'\\x00\\x01' from stdin\n0o600\n"
    for bad in ("../x", "/etc/x", "a/../../x", "", "main.py"):
        with pytest.raises(SandboxError, match="sandbox files"):
            sandbox.run("print(1)", files={bad: "x"})
    assert_nothing_left(result)


def test_a_missing_program_is_start_failed_with_bwraps_reason(sandbox: BwrapSandbox) -> None:
    result = sandbox.run(argv=["/no/such/program"])
    assert (result.outcome, result.exit_code) == (Outcome.START_FAILED, 1)
    assert result.stderr == "bwrap: execvp /no/such/program: No such file or directory\n"
    assert_nothing_left(result)


def test_unsafe_subprocess_needs_the_opt_in_and_says_so_on_every_result(sandbox: BwrapSandbox) -> None:
    with pytest.raises(SandboxError, match="must be chosen explicitly"):
        create_sandbox("unsafe_subprocess")
    unsafe = create_sandbox("unsafe_subprocess", allow_unsafe=True)
    results = [unsafe.run("print(6 * 7)"), unsafe.run("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=1))]
    assert [(r.outcome, r.stdout) for r in results] == [(Outcome.OK, "42\n"), (Outcome.TIMEOUT, "")]
    assert all(r.unsafe and r.backend == "unsafe_subprocess" and "without a sandbox" in (r.warning or "")
               for r in results)
    safe = sandbox.run("print(1)")
    assert (safe.unsafe, safe.warning) == (False, None)


def test_a_missing_bwrap_or_sandbox_user_is_refused_naming_the_fix(shared_dir: Path) -> None:
    with pytest.raises(SandboxUnavailable, match="install the Debian package bubblewrap"):
        create_sandbox("bwrap", options={"bwrap": "/no/such/bwrap"})
    with pytest.raises(SandboxError, match=r"^sandbox: unknown backend 'docker'; known: bwrap, unsafe_subprocess$"):
        create_sandbox("docker")
    with pytest.raises(SandboxError, match=r"^sandbox bwrap options: ro_binds: 'venv' must be an absolute"):
        create_sandbox("bwrap", options={"ro_binds": ["venv"]})
    old = shared_dir / "bwrap"
    old.write_text("#!/bin/sh\necho 'bubblewrap 0.6.1'\n")
    old.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match=r"is version 0\.6\.1; 0\.8\.0 or newer is needed"):
        create_sandbox("bwrap", options={"bwrap": str(old)})
    if os.geteuid() == 0 and os.path.exists("/usr/bin/bwrap"):
        with pytest.raises(SandboxUnavailable, match="useradd --system"):
            create_sandbox("bwrap", options={"user": "pe-no-such-user"})


def test_code_cannot_create_a_user_namespace(sandbox: BwrapSandbox) -> None:
    """`--disable-userns`: no nested namespace in which the program would be root again."""
    code = ATTEMPT + (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def unshare():\n"
        "    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER\n"
        "        raise OSError(ctypes.get_errno(), 'unshare')\n"
        "attempt('userns', unshare)\n"
    )
    result = sandbox.run(code)
    assert result.stdout == "userns ENOSPC\n", result.stderr
    assert_nothing_left(result)


def test_ro_binds_are_readable_and_stay_read_only(shared_dir: Path) -> None:
    lib = shared_dir / "venv-lib"
    lib.mkdir(mode=0o755)
    (lib / "helper.py").write_text("ANSWER = 42\n")
    (lib / "helper.py").chmod(0o644)
    sandbox = create_sandbox("bwrap", options={"ro_binds": [str(lib)]})
    code = ATTEMPT + (
        f"sys.path.insert(0, {str(lib)!r})\nimport helper\nprint(helper.ANSWER)\n"
        f"attempt('write', lambda: open({str(lib / 'evil.py')!r}, 'w').write('x'))\n"
    )
    result = sandbox.run(code)
    assert result.stdout == "42\nwrite EROFS\n", result.stderr
    assert sorted(p.name for p in lib.iterdir()) == ["helper.py"]
    assert_nothing_left(result)


def test_the_documented_example_and_defaults(sandbox: BwrapSandbox) -> None:
    """docs/agentic.md: the example's result, and the limits' defaults."""
    result = create_sandbox().run("print(6 * 7)", files={"data.csv": "a,b\n1,2\n"},
                                  limits=SandboxLimits(wall_s=10, memory_mb=512))
    assert (result.outcome, result.exit_code, result.stdout) == (Outcome.OK, 0, "42\n")
    assert isinstance(sandbox, Sandbox)
    assert isinstance(create_sandbox("unsafe_subprocess", allow_unsafe=True), Sandbox)
    assert SandboxLimits().model_dump() == {
        "wall_s": 30.0, "cpu_s": 30, "memory_mb": 1024, "processes": 64, "output_bytes": 1 << 20, "file_mb": 16,
        "disk_mb": 64, "open_files": 256,
    }


def test_file_size_and_work_dir_size_are_capped(sandbox: BwrapSandbox) -> None:
    code = ATTEMPT + (
        "def fill(name, n):\n"
        "    with open(name, 'wb') as f:\n"
        "        f.write(b'x' * n)\n"
        "attempt('big-file', lambda: fill('big', 2 << 20))\n"
        "os.remove('big')\n"
        "for i in range(3):\n"
        "    attempt(f'file-{i}', lambda: fill(f'f{i}', 900 << 10))\n"
    )
    result = sandbox.run(code, limits=SandboxLimits(file_mb=1, disk_mb=2))
    assert result.stdout == "big-file EFBIG\nfile-0 ok\nfile-1 ok\nfile-2 ENOSPC\n", result.stderr
    assert_nothing_left(result)


AS_NORMAL_USER = """
import os, sys
from pinned_eval.sandbox import BwrapSandbox, SandboxLimits  # imported as root: the venv is under /root
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([])
os.setresgid(gid, gid, gid)
os.setresuid(uid, uid, uid)
code = (
    "import os, time\\nprint(os.getuid())\\nchildren = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n"
    "            time.sleep(600)\\n            os._exit(0)\\n        children += 1\\nexcept OSError as exc:\\n"
    "    print(children, exc.errno)\\n"
)
print(BwrapSandbox().run(code, limits=SandboxLimits(processes=8)).model_dump_json())
"""


def test_a_worker_that_is_not_root_runs_sandboxes_in_a_user_namespace(neighbour: Neighbour) -> None:
    """No uid switch: bwrap's user namespace maps the worker's uid to 65534, and RLIMIT_NPROC is the
    uid's tasks at start (this worker process) plus `processes`: 8 - bwrap - the program = 6 forks."""
    require_bwrap()
    done = subprocess.run([sys.executable, "-c", AS_NORMAL_USER, str(neighbour.uid), str(neighbour.gid)],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          timeout=60)
    assert done.returncode == 0, done.stderr
    result = RunResult.model_validate_json(done.stdout)
    assert (result.outcome, result.stdout) == (Outcome.OK, "65534\n6 11\n")
    assert namespace_members(result.pid_namespace or 0) == []
