"""An agentic point as a real Prefect flow run: 2 CPU engines (scripted decoding) behind the real
sglang-router, a suite loaded from a miles-shaped YAML (`pinned-eval suite miles`).

- a retool-style multi-turn dataset (miles' generate hub `multi_turn`, the stock sandboxed Python
  tool: the model's `print(6*7)` really runs in bubblewrap), the same with examples/agentic's own
  generate function, next to a plain single-turn dataset:
  the point is measured, every sample at the pinned version, the tool's output in the stored
  samples;
- a runaway function is the point's skip with its reason: endless turns stop at the suite's
  `agent_max_turns` (`agent_error`), a sleeping one at `agent_sample_timeout_s`, and nothing of
  it stays running; a used-up `agent_max_requests` is `agent_budget`;
- a reply of another weight version in the middle of a sample (the fleet relabelled between two
  turns) is `pin_violation`.
The generate functions import from the suites' `python_path` (no PYTHONPATH names them): the
worker's runner uses the roots the suite load checked.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from app.cli import app
from blocks import SinksBlock
from pinned_eval.fleet.launcher import LaunchedFleet
from pinned_eval.results.store import SAMPLES
from pinned_eval.sinks import JsonlSink
from pinned_eval.suite import EvalSuite
from tests.pointkit import launched_point_env, run_staged_point, scripted_fleet

pytestmark = pytest.mark.e2e
FIXTURES = Path(__file__).parent.parent / "fixtures" / "miles_style"
EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "agentic"
YAML = FIXTURES / "agentic_point" / "eval.yaml"
# miles' own multi_turn with miles' own Python tool (examples/retool_v2/tool_sandbox.py) on this dataset
# against this engine's RULES at version 3: scripts/record_miles_generate_goldens.py
GOLDEN = Path(__file__).parent.parent / "data" / "miles_generate_golden.jsonl"
MILES_TOOL = "examples.retool_v2.tool_sandbox.execute_tool"
CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
RULES = [
    {"prompt_contains": "Output:\n42", "completion": "So the answer is \\boxed{42}."},
    {"prompt_contains": "What is 6*7?", "completion": CALL},
    {"prompt_contains": "Name a prime.", "completion": "\\boxed{7}"},
    {"prompt_contains": "loop forever", "completion": "again"},
    {"prompt_contains": "hold on", "completion": "held"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model
    from tests.pointkit import SESSION_ROOTS

    SESSION_ROOTS.append(str(tmp_path_factory.getbasetemp()))
    return make_tiny_model(tmp_path_factory.mktemp("ap") / "m", arch="llama", seed=0, chat_template="chatml")


@pytest.fixture(scope="module")
def fleet(model: Path) -> Iterator[LaunchedFleet]:
    with scripted_fleet(model, RULES, tool_call_parser="qwen25") as launched:
        yield launched


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


_env = launched_point_env
_run = run_staged_point


def _runaway(tmp_path: Path, function: str, rows: list[dict], **limits: object) -> EvalSuite:
    _write(tmp_path / "loop.jsonl", rows)
    extra = "".join(f"      {k}: {v}\n" for k, v in limits.items())
    text = (f"eval:\n  defaults: {{temperature: 0.0, max_response_len: 4, python_path: [{FIXTURES}]}}\n  datasets:\n"
            f"    - name: loop\n      path: {tmp_path}/loop.jsonl\n      rm_type: math\n"
            f"      custom_generate_function_path: {function}\n{extra}")
    return EvalSuite.from_miles_yaml(text)


def test_agentic_point_is_measured_at_the_pinned_version_with_the_tool_run_in_the_sandbox(
    prefect_server: str, fleet: LaunchedFleet, model: Path, tmp_path: Path
) -> None:
    [g] = [x for line in GOLDEN.read_text().splitlines() if (x := json.loads(line))["fixture"]
           == "miles.rollout.generate_hub.multi_turn.generate"
           and x["miles_args"]["generate_execute_tool_function_path"] == MILES_TOOL]
    _write(tmp_path / "retool.jsonl", [{"prompt": g["prompt"], "label": g["label"]}])
    _write(tmp_path / "plain.jsonl", [{"prompt": "Name a prime.", "label": "7"}])
    shown = CliRunner().invoke(app, ["suite", "miles", str(YAML), "--set", f"DATA_DIR={tmp_path}"])
    assert shown.exit_code == 0, shown.output
    assert [d["name"] for d in json.loads(shown.stdout)] == ["retool", "retool_custom", "plain"]
    suite = EvalSuite.from_miles_yaml(YAML, variables={"DATA_DIR": str(tmp_path)})
    env = _env(tmp_path, fleet, suite)

    state = _run(env, 3, model)

    assert state.name == "Completed", state.message
    rows = {r.dataset: r for r in JsonlSink(env.jsonl).read(env.run)}
    assert {d: (r.state, r.weight_version, r.metrics[f"eval/{d}"]) for d, r in rows.items()} == {
        "retool": ("measured", "3", 1.0), "retool_custom": ("measured", "3", 1.0), "plain": ("measured", "3", 1.0)}
    assert rows["retool"].metrics["eval/retool/weight_version/mixed_version_ratio"] == 0
    samples = SinksBlock.load(env.blocks["sinks"]).results_store().read(env.run, 3, SAMPLES).to_pylist()
    by = {s["dataset"]: s for s in samples}
    [want] = g["samples"]  # the stock tool in the sandbox answers as miles' own tool does
    assert (by["retool"]["response"], by["retool"]["status"], by["retool"]["reward"]) == (
        want["response"], want["status"], want["reward_value"])
    assert want["weight_versions"] == [by["retool"]["weight_version"]] * by["retool"]["turns"]
    assert by["retool"]["response"].startswith(CALL)
    assert "Output:\n42" in by["retool"]["response"]  # print(6*7) ran in the sandbox
    assert by["retool"]["response"].endswith("So the answer is \\boxed{42}.</s>")  # EOS text kept, as in miles
    assert by["retool_custom"]["response"] == (f"{CALL}</s>\n<tool_response>\nOutput:\n42\n</tool_response>\n"
                                               "So the answer is \\boxed{42}.</s>")
    assert {d: (s["weight_version"], s["reward"]) for d, s in by.items()} == {
        "retool": ("3", 1.0), "retool_custom": ("3", 1.0), "plain": ("3", 1.0)}


def test_endless_turns_stop_at_the_suites_turn_limit(
    prefect_server: str, fleet: LaunchedFleet, model: Path, tmp_path: Path
) -> None:
    suite = _runaway(tmp_path, "runaway.endless", [{"prompt": "loop forever", "label": "1"}], agent_max_turns=3)
    state = _run(_env(tmp_path, fleet, suite), 4, model)
    assert state.name == "Skipped", state.message
    assert state.message.startswith("agent_error: dataset 'loop' sample 0 (j=0): "), state.message
    assert state.message.endswith(" (the sample reached the gateway's max_turns_per_sample)"), state.message


def test_point_budget_is_agent_budget(
    prefect_server: str, fleet: LaunchedFleet, model: Path, tmp_path: Path
) -> None:
    suite = _runaway(tmp_path, "runaway.endless", [{"prompt": "loop forever", "label": "1"}], agent_max_requests=5)
    state = _run(_env(tmp_path, fleet, suite), 5, model)
    assert state.name == "Skipped", state.message
    assert state.message.startswith("agent_budget: the point's max_requests (5) is used up"), state.message


def test_a_sleeping_function_is_cut_at_the_deadline_and_leaves_nothing_running(
    prefect_server: str, fleet: LaunchedFleet, model: Path, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    suite = _runaway(tmp_path, "runaway.sleeps", [{"prompt": "hold on", "label": "1", "pid_file": str(pid_file)}],
                     agent_sample_timeout_s=3)
    state = _run(_env(tmp_path, fleet, suite), 6, model)
    assert state.name == "Skipped", state.message
    assert state.message.startswith("agent_error: dataset 'loop' sample 0 (j=0): TimeoutError: no result within 3 s")
    runner, child = map(int, pid_file.read_text().split())
    for pid in (runner, child):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_another_version_between_two_turns_is_pin_violation(
    prefect_server: str, fleet: LaunchedFleet, model: Path, tmp_path: Path
) -> None:
    gates = tmp_path / "gates"
    gates.mkdir()
    suite = _runaway(tmp_path, "relabel_midway.generate", [{"prompt": "hold on", "label": "1", "gate_dir": str(gates)}])
    assert fleet.keys is not None
    admin = {"Authorization": f"Bearer {fleet.keys.admin}"}
    stop = threading.Event()
    relabelled: list[str] = []

    def relabel_at_each_gate() -> None:  # every attempt of the point stops at a gate: relabel, then go
        while not stop.is_set():
            for gate in sorted(gates.iterdir()):
                if gate.suffix or gate.name in relabelled:
                    continue
                for url in fleet.engine_urls:
                    r = httpx.post(f"{url}/update_weight_version", json={"new_version": "999"}, headers=admin)
                    r.raise_for_status()
                relabelled.append(gate.name)
                (gates / f"{gate.name}.go").touch()
            stop.wait(0.02)

    watcher = threading.Thread(target=relabel_at_each_gate, daemon=True)
    watcher.start()
    try:
        state = _run(_env(tmp_path, fleet, suite), 8, model)
    finally:
        stop.set()
        watcher.join()
    assert state.name == "Skipped", state.message
    assert state.message.startswith("pin_violation"), state.message
    assert "999" in state.message and relabelled
