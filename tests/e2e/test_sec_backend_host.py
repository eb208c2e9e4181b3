"""The backend host as a real process: what it launched dies with it (a SIGKILLed host orphans no
server and its successor replaces the stale socket), and a synchronous backend whose client left
keeps its configuration until its call really returns (one version per backend)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pinned_eval.backend_host import evaluate_hosted, host_command, host_health, wait_host_ready
from pinned_eval.external import EvalInput
from pinned_eval.polling import poll_until
from tests.hosted_backends import read_lifecycle
from tests.pointkit import SMALL_SUITE

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


class Host:
    def __init__(self, sock: Path, log: Path) -> None:
        self.sock, self.log = sock, log
        sock.parent.mkdir(mode=0o700, exist_ok=True)  # the operator's private directory
        with open(log, "a") as out:
            self.proc = subprocess.Popen(host_command(sock), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        wait_host_ready(sock)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    started: list[Host] = []
    yield started
    for h in started:
        h.kill()


def _input(step: int) -> EvalInput:
    return EvalInput(run="exp42", step=step, hf_dir=f"/snap/step_{step}", suite=SMALL_SUITE)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_sigkilled_host_orphans_nothing_and_its_successor_replaces_the_socket(
    hosts: list[Host], tmp_path: Path
) -> None:
    sock, log = tmp_path / "sockets" / "backends.sock", str(tmp_path / "lifecycle.jsonl")
    host = Host(sock, tmp_path / "host.log")
    hosts.append(host)
    evaluate_hosted(sock, "tests.hosted_backends:ChildLaunchingBackend", {"log": log}, "/s", _input(1))
    [init] = read_lifecycle(log)
    child = init["child"]
    try:
        assert init["pid"] == host.proc.pid and not _gone(child), "the backend launched its server in the host"
        assert psutil.Process(child).ppid() == host.proc.pid and os.getpgid(child) == child, "its own group"
        host.kill()  # SIGKILL: no shutdown hook runs, dispose() never comes
        poll_until(lambda: _gone(child), timeout_s=30, what=f"the host's child {child} to die with it")
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
    assert sock.exists(), "a SIGKILLed host leaves its socket behind"
    successor = Host(sock, tmp_path / "host-2.log")  # the stale socket is replaced, not an error
    hosts.append(successor)
    assert host_health(sock)["pid"] == successor.proc.pid


def _client(sock: Path, options: dict[str, str], step: int) -> subprocess.Popen[str]:
    """One point from a separate interpreter, as a flow-run process sends it."""
    code = (
        "import json, sys\n"
        "from pinned_eval.backend_host import evaluate_hosted\n"
        "from tests.e2e.test_sec_backend_host import _input\n"
        "res = evaluate_hosted(sys.argv[1], 'tests.hosted_backends:GatedSyncBackend', json.loads(sys.argv[2]), "
        "'/s', _input(int(sys.argv[3])))\n"
        "print(sorted({v for r in res.data.values() for v in r.weight_versions}))\n"
    )
    return subprocess.Popen([sys.executable, "-c", code, str(sock), json.dumps(options), str(step)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_sync_backend_whose_client_left_holds_its_configuration_until_its_call_returns(
    hosts: list[Host], tmp_path: Path
) -> None:
    sock, log, gate = tmp_path / "sockets" / "backends.sock", str(tmp_path / "lifecycle.jsonl"), tmp_path / "gate"
    gate.mkdir()
    host = Host(sock, tmp_path / "host.log")
    hosts.append(host)
    options = {"log": log, "gate": str(gate)}

    def events() -> list[tuple[str, str | None]]:
        return [(e["event"], e["version"]) for e in read_lifecycle(log)]

    first = _client(sock, options, 1)
    poll_until(lambda: ("pin", "1") in events(), timeout_s=60, what="the first point's pin")
    first.kill()  # its point's deadline, a killed flow run: the sync call goes on in the host's thread
    first.wait(timeout=30)
    second = _client(sock, options, 2)
    try:
        # the host noticed the first client left, and the second point is queued (or, broken: it pinned)
        poll_until(lambda: ("pin", "2") in events() or (
            "the client left during a synchronous evaluation" in host.log.read_text()
            and host_health(sock).get("waiting") == 1), timeout_s=60, what="the second point to queue")
        assert ("pin", "2") not in events(), f"the second point pinned while the first still ran: {events()}"
        (gate / "release-1").touch()  # the first's call returns
        poll_until(lambda: ("pin", "2") in events(), timeout_s=60, what="the second point's pin")
        (gate / "release-2").touch()
        out, err = second.communicate(timeout=60)
    finally:
        second.kill()
    assert second.returncode == 0 and out.strip() == "['2']", err
    lifecycle = read_lifecycle(log)
    assert [(e["event"], e["version"]) for e in lifecycle] == [
        ("init", None), ("pin", "1"), ("evaluated", "1"), ("dispose", None),  # dropped as a cancelled one
        ("init", None), ("pin", "2"), ("evaluated", "2"),
    ]
    [entry] = host_health(sock)["backends"]
    assert entry["evaluations"] == 1 and host_health(sock)["waiting"] == 0
