"""Nothing lost to a sink, on real points (real Prefect server, CPU fleet, W&B, the artifacts API).

- W&B fails for real (its run directory `<wandb_dir>/wandb` is a regular file: NotADirectoryError
  at init, root or not) → the point is Completed as measured, its JSONL rows intact and carrying
  `sink_errors` / `eval/sink_failed_wandb`, a WARNING names the sink, the state message says so.
- The artifacts API answers 500 (a `FaultyHTTPProxy` in front of the Prefect API, the point run in a
  subprocess pointed at it) → the same, for `artifacts`; a single 500 is retried and leaves no trace.
- A bad line in the JSONL file does not fail another run's point (a reader names it); a non-UTF-8 dataset line fails
  the point before any export naming the file and line, as every other bad row does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from prefect import get_client
from prefect.artifacts import Artifact
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel

from blocks import FleetBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.points import history_artifact_key
from pinned_eval.polling import poll_until
from pinned_eval.sinks import JsonlSink
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults
from tasks.admission import admitted
from tests.conftest import free_port
from tests.pointkit import CpuFleet, PointEnv, save_point_blocks, write_step_snapshot
from tests.reliability.netfaults import FaultyHTTPProxy, Rule

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _fleet(cpu_fleet: CpuFleet) -> FleetBlock:
    return FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))


def _dead_fleet() -> FleetBlock:
    dead = f"http://127.0.0.1:{free_port()}"
    return FleetBlock(name=f"d{uuid.uuid4().hex[:6]}", mode="attach", engine_urls=[dead], router_url=dead)


def _staged(env: PointEnv, step: int, tiny: Path | None = None) -> dict[str, str]:
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)
    if tiny is not None:
        write_step_snapshot(tiny, dest)
    return {"kind": "staged", "path": dest}


def _warnings(flow_run_id: object, needle: str) -> list[str]:
    """The run's WARNING logs once one contains `needle` (logs reach the API in batches)."""

    def found() -> list[str] | None:
        with get_client(sync_client=True) as c:
            logs = c.read_logs(
                log_filter=LogFilter(
                    flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]),  # type: ignore[list-item]
                    level=LogFilterLevel(ge_=30),
                )
            )
        messages = [log.message for log in logs]
        return messages if any(needle in m for m in messages) else None

    return poll_until(found, timeout_s=30, interval_s=0.5, what=f"a WARNING log containing {needle!r}")


def _assert_measured_with_sink_errors(env: PointEnv, step: int, errors: dict[str, str]) -> None:
    """Both datasets measured at `step`, each row carrying exactly `errors` (sink -> error prefix)."""
    rows = JsonlSink(env.jsonl).read(env.run)
    assert sorted(r.dataset or "" for r in rows) == ["arith_add", "arith_sub"]
    for r in rows:
        assert (r.state, r.step, r.weight_version) == ("measured", step, str(step))
        assert sorted(r.sink_errors) == sorted(errors), r.sink_errors
        assert all(r.sink_errors[sink].startswith(prefix) for sink, prefix in errors.items()), r.sink_errors
        assert r.metrics[f"eval/{r.dataset}/weight_version/mean"] == step
        failed = {k: v for k, v in r.metrics.items() if k.startswith("eval/sink_failed_")}
        assert failed == {f"eval/sink_failed_{sink}": 1 for sink in errors}


def test_wandb_failure_leaves_the_point_measured_with_the_error_beside_it(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path
) -> None:
    env = save_point_blocks(tmp_path, _fleet(cpu_fleet), wandb=True, keep_snapshots=0)
    (tmp_path / "wandb").write_text("a file where W&B wants its run directory\n")
    state = eval_point(**env.params(5, source=_staged(env, 5, tiny_model)), return_state=True)  # type: ignore[arg-type]
    assert state.is_completed() and state.name == "Completed", state.message
    assert state.message.startswith(f"measured {env.run}/step-5: arith_add=")
    assert "; sink failed: wandb (NotADirectoryError" in state.message
    _assert_measured_with_sink_errors(env, 5, {"wandb": "NotADirectoryError"})
    history = Artifact.get(history_artifact_key(env.run))  # the other sinks still got the point
    assert history is not None
    table = json.loads(history.data) if isinstance(history.data, str) else history.data
    assert [(row["step"], row["state"]) for row in table] == [(5, "measured")]
    warnings = _warnings(state.state_details.flow_run_id, "sink wandb failed")
    assert any(f"sink wandb failed for {env.run}/step-5 after 3 attempts" in m and "NotADirectoryError" in m
               for m in warnings), warnings


_RUN_POINT = """
import json, sys
from flows.eval_point import eval_point
state = eval_point(**json.loads(sys.argv[1]), return_state=True)
print("STATE " + json.dumps({"type": state.type.value, "name": state.name, "message": state.message,
                             "flow_run_id": str(state.state_details.flow_run_id)}))
"""


# "always": every artifact call fails: the progress artifact once (then progress stops), the
# per-sample table (score task) and the point's table (log task) 3 times each;
# "once": the per-sample table fails once, its retry passes, then the point's table and history
# (`passed` counts the table artifacts created)
@pytest.mark.parametrize(
    ("rule", "errors", "passed"),
    [
        (Rule("error", methods=("POST", "PATCH"), path_contains="/api/artifacts/"), 7, 0),
        (Rule("error", methods=("POST",), path_contains="/api/artifacts/", body_contains=b'"table"', times=1), 1, 3),
    ],
    ids=["always", "once"],
)
def test_artifact_api_failure_leaves_the_point_measured_and_a_single_one_is_retried(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path, rule: Rule, errors: int,
    passed: int,
) -> None:
    env = save_point_blocks(tmp_path, _fleet(cpu_fleet), keep_snapshots=0)
    params = env.params(6, source=_staged(env, 6, tiny_model))
    proxy = FaultyHTTPProxy(prefect_server.removesuffix("/api"), [rule])
    try:
        env_vars = {**os.environ, "PREFECT_API_URL": f"{proxy.url}/api", "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-c", _RUN_POINT, json.dumps(params)], cwd=REPO, env=env_vars,
                              capture_output=True, text=True, timeout=300)
    finally:
        proxy.close()
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("STATE ")] or [proc.stdout + proc.stderr[-3000:]]
    state = json.loads(line.removeprefix("STATE "))
    assert (state["type"], state["name"]) == ("COMPLETED", "Completed"), (state, proc.stderr[-3000:])
    tables = [s for s in proxy.seen("pass", "/api/artifacts/") if s.method == "POST" and b'"table"' in s.body]
    assert (len(proxy.seen("error", "/api/artifacts/")), len(tables)) == (errors, passed)
    if rule.times is None:
        message = state["message"]
        assert "; sink failed: artifacts (PrefectHTTPStatusError: Server error '500" in message, message
        assert "; samples (per-sample artifact not written" in message, message
        _assert_measured_with_sink_errors(env, 6, {"artifacts": "PrefectHTTPStatusError", "samples": "per-sample"})
        warnings = _warnings(uuid.UUID(state["flow_run_id"]), "sink artifacts failed")
        assert any("sink samples failed" in m and "PrefectHTTPStatusError" in m for m in warnings), warnings
    else:
        assert "sink failed" not in state["message"], state["message"]
        assert [r.sink_errors for r in JsonlSink(env.jsonl).read(env.run)] == [{}, {}]
        assert Artifact.get(f"{history_artifact_key(env.run)}-step-6") is not None


def test_a_bad_line_in_the_jsonl_file_does_not_fail_another_runs_point(prefect_server: str, tmp_path: Path) -> None:
    env = save_point_blocks(tmp_path, _dead_fleet())
    bad = b'{"run": "other", "step": 1, "state": "meas\n'
    env.jsonl.write_bytes(bad)
    with admitted(env.run, 1, policy="skip", final=False, max_in_flight=1):
        state = eval_point(**env.params(2, source=_staged(env, 2), policy="skip", max_in_flight=1), return_state=True)  # type: ignore[arg-type]
    assert state.is_completed() and state.name == "Skipped", state.message
    assert state.message.startswith("busy")
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert row.metrics["eval/skipped_busy"] == 1
    assert env.jsonl.read_bytes().startswith(bad), "the bad line is kept, in place"
    reader = JsonlSink(env.jsonl)  # the point appended without reading the file: its readers name the line
    reader.read()
    assert [p.split(" (")[0] for p in reader.bad_lines] == [f"{env.jsonl}:1: not a metric row"]


def test_non_utf8_dataset_fails_the_point_before_export_naming_file_and_line(
    prefect_server: str, tmp_path: Path
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "label": "2"}\n{"prompt": "caf\xe9", "label": "x"}\n')
    suite = EvalSuite(datasets=(DatasetSpec(name="rows", path=str(data)),),
                      defaults=SamplingDefaults(temperature=0.0, max_new_tokens=2))
    env = save_point_blocks(tmp_path, _dead_fleet(), suite=suite)
    source = _staged(env, 3)
    state = eval_point(**env.params(3, source=source), return_state=True)  # type: ignore[arg-type]
    assert state.is_failed(), state.message
    assert f"{data}: line 2: not UTF-8 text (byte 0xe9 at byte column 16)" in state.message, state.message
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert (row.state, row.metrics["eval/skipped_crashed"]) == ("failed", 1)
    assert not Path(source["path"]).exists(), "nothing was exported"
