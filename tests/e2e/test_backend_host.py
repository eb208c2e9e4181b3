"""The backend host as a real process on a Unix socket: one instance per configuration serves
clients from other processes, a crash or a departed client drops it, SIGTERM disposes the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import get_client

from pinned_eval.backend_host import (
    BackendError,
    BackendHostUnavailable,
    evaluate_hosted,
    host_command,
    host_health,
    wait_host_ready,
)
from pinned_eval.backends import backend_lock_name
from pinned_eval.external import EvalInput
from pinned_eval.polling import poll_until
from pinned_eval.sinks import JsonlSink
from pinned_eval.skips import EvalSkipped
from tests.deploykit import Deployed, wait_for
from tests.hosted_backends import read_lifecycle
from tests.pointkit import SMALL_SUITE, PointEnv, save_point_blocks, write_step_snapshot

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
BACKEND = "tests.hosted_backends:LifecycleBackend"


class Host:
    def __init__(self, tmp: Path) -> None:
        self.socket = tmp / "backends.sock"  # AF_UNIX paths are short: pytest's tmp_path fits
        self.log = open(tmp / "host.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(host_command(self.socket), cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_host_ready(self.socket)

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.log.close()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path)
    try:
        yield h
    finally:
        if h.proc.poll() is None:
            os.killpg(h.proc.pid, signal.SIGKILL)
            h.proc.wait(timeout=30)
        h.log.close()


def _input(step: int) -> EvalInput:
    return EvalInput(run="exp42", step=step, hf_dir=f"/snap/step_{step}", suite=SMALL_SUITE)


def _client_process(sock: Path, options: dict[str, object], step: int) -> subprocess.CompletedProcess[str]:
    """One evaluation from a separate interpreter, as a flow-run process would send it."""
    code = (
        "import json, sys\n"
        "from pinned_eval.backend_host import evaluate_hosted\n"
        "from pinned_eval.external import EvalInput\n"
        "from tests.pointkit import SMALL_SUITE\n"
        f"inp = EvalInput(run='exp42', step={step}, hf_dir='/snap/step_{step}', suite=SMALL_SUITE)\n"
        f"res = evaluate_hosted({str(sock)!r}, {BACKEND!r}, json.loads(sys.argv[1]), '/snap/step_{step}', inp)\n"
        "print(sorted(set(v for r in res.data.values() for v in r.weight_versions)))\n"
    )
    return subprocess.run([sys.executable, "-c", code, json.dumps(options)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_one_instance_serves_processes_serially_and_sigterm_disposes_it(host: Host, tmp_path: Path) -> None:
    log = str(tmp_path / "lifecycle.jsonl")
    options = {"log": log, "delay_s": 1.0}
    for step in (1, 2):  # two flow-run-like processes, one after the other
        done = _client_process(host.socket, options, step)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"['{step}']"
    # two points in flight at once (two threads of one process): the host serializes them
    threads = [threading.Thread(target=evaluate_hosted, args=(host.socket, BACKEND, options, f"/s{s}", _input(s)))
               for s in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    [entry] = host_health(host.socket)["backends"]
    assert entry["backend"] == BACKEND and entry["evaluations"] == 4
    assert host.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    events = read_lifecycle(log)
    assert {e["pid"] for e in events} == {host.proc.pid}, "constructed, used and disposed in the host"
    assert len({e["instance"] for e in events}) == 1
    kinds = [e["event"] for e in events]
    assert kinds == ["init"] + ["pin", "evaluated"] * 4 + ["dispose"], kinds
    assert [e["version"] for e in events if e["event"] == "pin"][:2] == ["1", "2"]
    assert not host.socket.exists()


def test_skip_keeps_the_instance_a_crash_replaces_it(host: Host, tmp_path: Path) -> None:
    log = str(tmp_path / "lifecycle.jsonl")
    with pytest.raises(EvalSkipped) as skip:
        evaluate_hosted(host.socket, BACKEND, {"log": log, "mode": "quota"}, "/s", _input(5))
    assert (skip.value.reason, skip.value.message) == ("quota", "no credits left")
    with pytest.raises(BackendError, match="RuntimeError: engine died mid-eval") as err:
        evaluate_hosted(host.socket, BACKEND, {"log": log, "mode": "boom"}, "/s", _input(6))
    assert err.value.type_name == "RuntimeError"
    host_log = (tmp_path / "host.log").read_text()
    assert "tests.hosted_backends:LifecycleBackend failed on /s (step 6)" in host_log, host_log
    assert "Traceback" in host_log and "RuntimeError: engine died mid-eval" in host_log, "the host logs the traceback"
    with pytest.raises(BackendError, match="ValueError: model_path: no such checkpoint"):
        evaluate_hosted(host.socket, BACKEND, {"log": log, "mode": "bad_init"}, "/s", _input(8))
    boom = [e for e in read_lifecycle(log) if e["event"] in ("init", "dispose")]
    assert [e["event"] for e in boom] == ["init", "init", "dispose"], "the crashed one disposed, the skipped kept"
    [kept] = host_health(host.socket)["backends"]
    assert kept["config"] == backend_lock_name(BACKEND, {"log": log, "mode": "quota"}) and kept["evaluations"] == 0
    assert set(kept) == {"backend", "config", "evaluations"}, "no options (they may hold keys)"
    # the next point of the crashed configuration builds a fresh instance
    with pytest.raises(BackendError):
        evaluate_hosted(host.socket, BACKEND, {"log": log, "mode": "boom"}, "/s", _input(9))
    inits = [e["instance"] for e in read_lifecycle(log) if e["event"] == "init"]
    assert len(inits) == 3


def test_a_client_that_leaves_cancels_its_evaluation_and_drops_the_instance(host: Host, tmp_path: Path) -> None:
    log = str(tmp_path / "lifecycle.jsonl")
    options = {"log": log, "delay_s": 300.0, "tag": uuid.uuid4().hex}
    code = (
        "from pinned_eval.backend_host import evaluate_hosted\n"
        "from pinned_eval.external import EvalInput\n"
        "from tests.pointkit import SMALL_SUITE\n"
        "inp = EvalInput(run='exp42', step=3, hf_dir='/s', suite=SMALL_SUITE)\n"
        f"evaluate_hosted({str(host.socket)!r}, {BACKEND!r}, {options!r}, '/s', inp)\n"
    )
    client = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        poll_until(lambda: any(e["event"] == "pin" for e in read_lifecycle(log)), timeout_s=60, what="the pin")
    finally:
        client.kill()  # the point's process is gone (SIGKILL, or its deadline unwound the call)
        client.wait(30)
    events = poll_until(
        lambda: (ev := read_lifecycle(log)) and ev[-1]["event"] == "dispose" and ev, timeout_s=30,
        what="the host to cancel the evaluation and dispose the instance",
    )
    assert [e["event"] for e in events] == ["init", "pin", "cancelled", "dispose"]
    assert host_health(host.socket)["backends"] == []


def test_no_host_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(BackendHostUnavailable, match=r"nowhere\.sock"):
        evaluate_hosted(tmp_path / "nowhere.sock", BACKEND, {"log": "/dev/null"}, "/s", _input(1))


# ---------------------------------------------------------------------------- deployed external points


def _request(deployed: Deployed, env: PointEnv, step: int, tiny: Path, options: dict[str, object]) -> str:
    from blocks import ExternalBackendBlock

    snap = write_step_snapshot(tiny, str(env.staging_root.parent / f"hf_step_{step}"))
    block = f"host-{options['tag']}"  # the operator's saved backend; the point names it
    ExternalBackendBlock(backend=BACKEND, options=options).save(block, overwrite=True)
    params = env.params(step, source={"kind": "hf", "path": snap}, posture="external", max_in_flight=3,
                        backend_block=block)
    with get_client(sync_client=True) as c:
        return str(c.create_flow_run_from_deployment(deployed.deployment_id, parameters=params).id)


def _final(flow_run_id: str):  # type: ignore[no-untyped-def]
    def read():  # type: ignore[no-untyped-def]
        with get_client(sync_client=True) as c:
            fr = c.read_flow_run(flow_run_id)
        return fr if fr.state and fr.state.is_final() else None

    return wait_for(read, 240, f"flow run {flow_run_id} to finish", interval_s=1)


def _external_blocks(tmp_path: Path, **kw: object) -> PointEnv:
    from blocks import FleetBlock
    from tests.conftest import free_port

    dead = [f"http://127.0.0.1:{free_port()}"]  # the external posture never touches the fleet
    return save_point_blocks(tmp_path, FleetBlock(name="ext", mode="attach", engine_urls=dead, router_url=dead[0]),
                             **kw)  # type: ignore[arg-type]


def test_deployed_points_share_one_backend_in_the_host(deployed: Deployed, tiny_model: Path, tmp_path: Path) -> None:
    env = _external_blocks(tmp_path)
    log = str(tmp_path / "lifecycle.jsonl")
    options = {"log": log, "delay_s": 2.0, "tag": uuid.uuid4().hex}
    first = [_request(deployed, env, step, tiny_model, options) for step in (31, 32)]  # two in flight at once
    runs = [_final(fr) for fr in first]
    runs.append(_final(_request(deployed, env, 33, tiny_model, options)))  # and one after them
    assert [r.state.name for r in runs] == ["Completed"] * 3, [r.state.message for r in runs]
    events = read_lifecycle(log)
    assert {e["pid"] for e in events} == {deployed.backend_host_pid}, "built and run in the host, not per flow run"
    kinds = [(e["event"], e["version"]) for e in events]
    assert kinds[0] == ("init", None) and len({e["instance"] for e in events}) == 1, kinds
    pins = kinds[1:]
    assert all(pins[i][0] == "pin" and pins[i + 1] == ("evaluated", pins[i][1]) for i in range(0, len(pins), 2)), pins
    assert sorted(v for k, v in pins if k == "pin") == ["31", "32", "33"] and pins[-1] == ("evaluated", "33")
    config = backend_lock_name(BACKEND, options)
    [entry] = [b for b in host_health(deployed.backend_socket)["backends"] if b["config"] == config]
    assert entry["evaluations"] == 3
    measured = {(r.step, r.weight_version) for r in JsonlSink(env.jsonl).read(env.run)}
    assert measured == {(31, "31"), (32, "32"), (33, "33")}


def test_deployed_point_past_its_deadline_cancels_the_hosted_evaluation(
    deployed: Deployed, tiny_model: Path, tmp_path: Path
) -> None:
    env = _external_blocks(tmp_path, point_timeout_seconds=10)
    log = str(tmp_path / "lifecycle.jsonl")
    options = {"log": log, "delay_s": 600.0, "tag": uuid.uuid4().hex}
    run = _final(_request(deployed, env, 41, tiny_model, options))
    assert run.state.name == "Skipped" and run.state.message.startswith("timed_out"), run.state.message
    events = poll_until(
        lambda: (ev := read_lifecycle(log)) and ev[-1]["event"] == "dispose" and ev, timeout_s=30,
        what="the host to cancel the evaluation and dispose the instance",
    )
    assert [e["event"] for e in events] == ["init", "pin", "cancelled", "dispose"]
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert row.step == 41 and row.metrics["eval/skipped_timed_out"] == 1
    with get_client(sync_client=True) as c:
        limit = c.read_global_concurrency_limit_by_name(backend_lock_name(BACKEND, options))
    assert (limit.limit, limit.active_slots) == (1, 0), "the backend lock is released"
