"""The `function` rollout kind's containment: user code that raises, hangs (leaving a child behind),
floods its output, blows up memory or returns junk becomes the point's `agent_error` skip naming the
dataset, the sample index and the exception type; nothing of it stays running. These functions make
no model call, so the point's session points at a closed port."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import httpx
import psutil
import pytest

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.rollout import ROLLOUTS, PointSession, run_rollouts
from pinned_eval.rollout.function import FunctionRollout
from pinned_eval.skips import EvalSkipped
from pinned_eval.suite import DatasetSpec, EvalSuite
from tests.conftest import free_port

FIXTURES = str(Path(__file__).parent.parent / "fixtures" / "miles_style")
GOLDEN = Path(__file__).parent.parent / "data" / "miles_generate_golden.jsonl"


def _ds(function: str):  # type: ignore[no-untyped-def]
    [ds] = EvalSuite(datasets=(DatasetSpec(name="agentic", path="/a.jsonl", generate_function=function,
                                           reward="math"),)).resolved()
    return ds


async def _run(function: str, rollout: FunctionRollout, metadata: dict | None = None) -> list:
    ds = _ds(function)
    rows = [EvalSample(0, "p0", "1", dict(metadata or {})), EvalSample(1, "p1", "2", dict(metadata or {}))]
    async with httpx.AsyncClient() as http:
        session = PointSession(RouterGenerator(http, f"http://127.0.0.1:{free_port()}", api_key="k"),
                               expected_version="5", rid_prefix="p5")
        async with rollout.open(session, [ds], {ds.name: rows}) as produce:
            return [await produce(ds, r, 0) for r in rows]


def _live_children() -> set[int]:
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _children_before() -> None:
    """What this process already ran before the test (a session's servers, other tests' children)."""
    _BEFORE.clear()
    _BEFORE.update(_live_children())


def _runner_pids() -> set[int]:
    """Processes the test started that still run: the runner and anything it spawned."""
    return _live_children() - _BEFORE


async def test_old_form_function_matches_miles_own_eval() -> None:
    """The old-signature fixture against the golden recorded with miles' own `generate_and_rm`
    (scripts/record_miles_generate_goldens.py): response, status, reward, sample for sample."""
    lines = [json.loads(x) for x in GOLDEN.read_text().splitlines()]
    goldens = [g for g in lines if g["fixture"] == "echo_old.generate"]
    assert [(g["prompt"], g["label"]) for g in goldens] == [("p0", "1"), ("p1", "2")]
    got = await _run("echo_old.generate", FunctionRollout(python_path=[FIXTURES]))
    assert [[{"response": s.response, "status": s.status, "reward_value": s.reward, "weight_versions": []}
             for s in samples] for samples in got] == [g["samples"] for g in goldens]


async def test_old_form_function_runs_with_miles_args_and_dataset_reward() -> None:
    [[s0], [s1]] = await _run("echo_old.generate", FunctionRollout(python_path=[FIXTURES]))
    assert (s0.response, s0.status, s0.finish_reason, s0.response_len) == ("p0|math|True|1024", "completed", "stop", 3)
    assert (s0.prompt_index, s0.sample_index, s1.prompt_index) == (0, 0, 1)
    assert (s0.reward, s1.reward) == (0.0, 0.0)  # math of "p0|math|True|1024" against "1": scored in the runner
    assert s0.weight_version is None and s0.turns == 0
    assert "function" in ROLLOUTS and not _runner_pids()


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("runaway.raises", r"^agent_error: dataset 'agentic' sample 0 \(j=0\): ValueError: boom on 0$"),
        ("runaway.returns_junk", r"^agent_error: dataset 'agentic' sample 0 \(j=0\): TypeError: the generate function "
                                 r"returned dict, not a Sample$"),
        ("runaway.floods", r"^agent_error: dataset 'agentic' sample 0 \(j=0\): OutputFlood: the runner wrote an event "
                           r"over 16777216 bytes$"),
        ("runaway.hogs", r"^agent_error: dataset 'agentic' sample 0 \(j=0\): MemoryError: $"),
    ],
)
async def test_user_code_failures_are_agent_error_skips(function: str, message: str) -> None:
    with pytest.raises(EvalSkipped, match=message) as info:
        await _run(function, FunctionRollout(python_path=[FIXTURES], memory_bytes=1 << 30))
    assert info.value.reason == "agent_error"
    assert not _runner_pids()


async def test_a_hang_is_cut_at_the_deadline_and_its_children_are_gone(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    with pytest.raises(EvalSkipped, match=r"^agent_error: dataset 'agentic' sample 0 \(j=0\): TimeoutError: no result "
                                          r"within 3 s$"):
        await _run("runaway.sleeps", FunctionRollout(python_path=[FIXTURES], sample_timeout_s=3),
                   {"pid_file": str(pid_file)})
    runner, child = map(int, pid_file.read_text().split())
    for pid in (runner, child):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not _runner_pids()
    assert os.getpid() not in (runner, child)


async def test_run_rollouts_flattens_and_skips_through_the_registry() -> None:
    ds = _ds("runaway.raises")
    async with httpx.AsyncClient() as http:
        session = PointSession(RouterGenerator(http, f"http://127.0.0.1:{free_port()}", api_key="k"),
                               expected_version="5", rid_prefix="p5")
        ROLLOUTS["function"].python_path = [FIXTURES]  # type: ignore[attr-defined]
        try:
            with pytest.raises(EvalSkipped, match="ValueError: boom on 0"):
                await run_rollouts(session, [ds], {ds.name: [EvalSample(0, "p", "1")]})
        finally:
            ROLLOUTS["function"].python_path = []  # type: ignore[attr-defined]


def test_documented_defaults() -> None:
    from pinned_eval.agentic.client import MAX_EVENT_BYTES, STDERR_TAIL

    rollout = FunctionRollout()
    assert (rollout.memory_bytes, rollout.sample_timeout_s, rollout.limits) == (4 << 30, None, None)
    assert (STDERR_TAIL, MAX_EVENT_BYTES) == (4096, 16 << 20)


def test_the_runner_dies_with_its_parent(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import asyncio, os\n"
        "from pinned_eval.agentic.client import AgentRunner\n"
        "async def main():\n"
        "    async with AgentRunner({}) as r:\n"
        "        print(r.pid, flush=True)\n"
        "        os._exit(0)  # no cleanup: only the parent-death signal can end the runner\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    pid = int(done.stdout.strip())
    with contextlib.suppress(psutil.NoSuchProcess):  # already gone
        psutil.Process(pid).wait(timeout=10)  # SIGKILLed by the kernel when its parent died
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_a_finished_sample_s_session_is_closed_so_a_lingering_call_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The function returns, leaving a task that calls the model for its sample afterwards: the
    rollout closed the sample's session, so the call is refused and the transcript stays as it was."""
    import pinned_eval.gateway as gateway_mod

    gateways: list = []
    enter = gateway_mod.PointGateway.__aenter__

    async def capture(self):  # type: ignore[no-untyped-def]
        gateways.append(self)
        return await enter(self)

    monkeypatch.setattr(gateway_mod.PointGateway, "__aenter__", capture)
    go, out = tmp_path / "go", tmp_path / "out"
    ds = _ds("lingers.generate")
    row = EvalSample(0, "p0", "1", {"go": str(go), "out": str(out)})
    async with httpx.AsyncClient() as http:
        session = PointSession(RouterGenerator(http, f"http://127.0.0.1:{free_port()}", api_key="k"),
                               expected_version="5", rid_prefix="p5")
        async with FunctionRollout(python_path=[FIXTURES]).open(session, [ds], {ds.name: [row]}) as produce:
            [sample] = await produce(ds, row, 0)
            [gateway] = gateways
            assert (sample.response, sample.status, sample.messages) == ("done", "completed", None)
            assert gateway.closed("agentic-0-0") and gateway.transcript("agentic-0-0") == []
            go.write_text("")
            await _until(out.exists)
            assert out.read_text() == ("404 session closed: DELETE /sessions/{id} ended sample 'agentic-0-0'; "
                                       "its transcript is final")
            assert gateway.transcript("agentic-0-0") == []
            assert session.counters.requests == 0  # nothing reached the fleet


async def _until(condition, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
