"""miles' `eval.delegate` in a real flow run: 2 CPU engines behind the real sglang-router, the suite
loaded from a miles YAML under `strict_miles` (tests/miles_configs/delegate_point.yaml, as miles
would run it), a delegate that speaks miles' protocol and, like NeMo-Skills, makes its own
generation calls with a real HTTP client through the `router_url` it was handed (the point's
gateway), with the OpenAI key `EMPTY`.

- measured: the delegate got miles' request (byte for byte what `request_body` builds for the URL
  it was handed), its `raw_metrics` are the point's `eval/...` metrics as miles names them, and
  every call it made is in the gateway's records (`delegate_calls.parquet`) at the pinned version;
- at a step where no dataset is due (`every_n_steps`), the delegate still runs, as miles runs it at
  every eval: the point pins the fleet for it alone (no generation) and is measured on one
  point-level row holding the delegate's metrics, which the miles adapter hands back;
- a delegate that answers 503, one that hangs past `timeout_secs`, and one that answers garbage
  each make the point a skip `delegate_failed` naming the delegate and why.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect import get_client

from blocks import FleetBlock, SinksBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.delegate import request_body
from pinned_eval.events import EVENT_MEASURED, point_resource
from pinned_eval.settings import PrefectApiSettings
from pinned_eval.sinks import JsonlSink
from pinned_eval.suite import EvalSuite
from tasks.delegate import DELEGATE_CALLS
from tests.eventkit import settled_events
from tests.pointkit import CpuFleet, PointEnv, save_point_blocks, write_step_snapshot
from trainer_integration.miles_adapter import AdapterConfig, PinnedEvalREST, collect_point

pytestmark = pytest.mark.e2e
YAML = Path(__file__).parent.parent / "miles_configs" / "delegate_point.yaml"
PROMPTS = [("1+1=", "2"), ("2+3=", "5")]


class SkillsLike:
    """A delegate service on loopback: `/evaluate` runs each benchmark's prompts x samples as chat
    completions against `<router_url>/v1` (api key EMPTY, model name as NeMo-Skills sends it) and
    answers `raw_metrics` per benchmark; `/error` answers 503, `/hang` waits for the test's end,
    `/garbage` answers HTML."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.texts: dict[str, list[str]] = {}
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.bodies.append(body)
                status, reply = outer.answer(self.path, body)
                self.send_response(status)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, path: str, body: bytes) -> tuple[int, bytes]:
        if path == "/error":
            return 503, b"overloaded"
        if path == "/hang":
            self.release.wait()
            return 200, b"{}"
        if path == "/garbage":
            return 200, b"<html>not json"
        job = json.loads(body)
        metrics: dict[str, Any] = {}
        with httpx.Client(timeout=60) as http:
            for bench in job["benchmarks"]:
                texts: list[str] = []
                for prompt, _ in PROMPTS:
                    for _ in range(bench["n_samples_per_eval_prompt"]):
                        r = http.post(f"{job['router_url']}/v1/chat/completions",
                                      headers={"Authorization": "Bearer EMPTY"},
                                      json={"model": "miles-openai-model", "temperature": bench["temperature"],
                                            "top_p": bench["top_p"], "max_tokens": bench["max_response_len"],
                                            "messages": [{"role": "user", "content": prompt}]})
                        r.raise_for_status()
                        texts.append(r.json()["choices"][0]["message"]["content"])
                self.texts.setdefault(bench["name"], []).extend(texts)
                metrics[bench["name"]] = {"pass@1": _pass_at_1(texts, bench["n_samples_per_eval_prompt"]),
                                          "num_entries": len(PROMPTS), "generations": len(texts),
                                          "judge": {"model": "none"}}
        return 200, json.dumps({"job_id": "1", "command": "ns eval", "raw_metrics": metrics}).encode()

    def __enter__(self) -> SkillsLike:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _pass_at_1(texts: list[str], n: int) -> float:
    answers = [a for _, a in PROMPTS for _ in range(n)]
    return sum(t.strip() == a for t, a in zip(texts, answers, strict=True)) / len(texts)


@pytest.fixture
def skills() -> Iterator[SkillsLike]:
    with SkillsLike() as service:
        yield service


def _point(
    tmp_path: Path, cpu_fleet: CpuFleet, tiny_model: Path, url: str, timeout: int, step: int,
    every_n_steps: int | None = None,
) -> tuple[Any, PointEnv]:
    (tmp_path / "add.jsonl").write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    suite = EvalSuite.from_miles_yaml(YAML, strict_miles=True, variables={
        "DATA_DIR": str(tmp_path), "DELEGATE_URL": url, "DELEGATE_TIMEOUT": str(timeout)})
    if every_n_steps is not None:  # pinned-eval's cadence (strict_miles refuses the key in the YAML)
        ds = suite.datasets[0].model_copy(update={"every_n_steps": every_n_steps})
        suite = suite.model_copy(update={"datasets": (ds,)})
    fleet = FleetBlock(name=f"d{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, suite=suite)  # keeps the snapshot: a rerun reuses it
    SinksBlock(jsonl_path=str(env.jsonl), results_root=str(tmp_path / "results")).save(env.blocks["sinks"],
                                                                                       overwrite=True)
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)
    write_step_snapshot(tiny_model, dest)
    return eval_point(**env.params(step, source={"kind": "staged", "path": dest}), return_state=True), env


def test_delegate_is_measured_through_the_gateway_at_the_pinned_version(
    prefect_server: str, cpu_fleet: CpuFleet, tiny_model: Path, tmp_path: Path, skills: SkillsLike
) -> None:
    state, env = _point(tmp_path, cpu_fleet, tiny_model, f"{skills.url}/evaluate", 120, 3)

    assert state.name == "Completed", state.message
    [body] = skills.bodies
    job = json.loads(body)
    suite = EvalSuite.from_miles_yaml(YAML, strict_miles=True, variables={
        "DATA_DIR": str(tmp_path), "DELEGATE_URL": f"{skills.url}/evaluate", "DELEGATE_TIMEOUT": "120"})
    assert body == request_body(suite.delegates[0], suite.fallbacks, 3, job["router_url"])
    assert job["benchmarks"] == [
        {"name": "aime25", "n_samples_per_eval_prompt": 2, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
         "max_response_len": 4},
        {"name": "hle", "n_samples_per_eval_prompt": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
         "max_response_len": 4},
    ]  # the delegate's defaults (max_response_len 4), not eval.defaults; miles' flags' defaults for the rest
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert (row.dataset, row.state, row.weight_version) == ("arith_add", "measured", "3")
    delegated = {k: v for k, v in row.metrics.items() if k.startswith(("eval/aime25/", "eval/hle/"))}
    assert delegated == {
        "eval/aime25/pass@1": _pass_at_1(skills.texts["aime25"][:4], 2), "eval/aime25/num_entries": 2.0,
        "eval/aime25/generations": 4.0,
        "eval/hle/pass@1": _pass_at_1(skills.texts["hle"][:2], 1), "eval/hle/num_entries": 2.0,
        "eval/hle/generations": 2.0,
    }
    calls = SinksBlock.load(env.blocks["sinks"]).results_store().read(env.run, 3, DELEGATE_CALLS).to_pylist()
    assert [(c["delegate"], c["route"], c["status"], c["weight_version"], c["error"]) for c in calls] == [
        ("skills", "/v1/chat/completions", 200, "3", None)] * 6
    assert all(c["completion_tokens"] >= 1 for c in calls)
    assert "/t/" in job["router_url"] and job["router_url"].rsplit("/t/", 1)[1] not in json.dumps(calls)
    # what the miles adapter hands back to miles: the delegate's metrics among the point's
    out = asyncio.run(_collect(prefect_server, env.run, str(state.state_details.flow_run_id), 3))
    assert {k: v for k, v in out.metrics.items() if k.startswith(("eval/aime25/", "eval/hle/"))} == delegated

    # the same point again: generations come from the cache, yet the fleet is pinned for the delegate
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, 3)
    again = eval_point(**env.params(3, source={"kind": "staged", "path": dest}), return_state=True)
    assert again.name == "Completed", again.message
    assert len(skills.bodies) == 2 and skills.texts["hle"][2:] == skills.texts["hle"][:2]  # greedy: the same
    with get_client(sync_client=True) as c:
        names = {t.name for t in c.read_task_runs() if t.flow_run_id == again.state_details.flow_run_id}
    assert {"cached-generations-3", "pin-3", "delegate-3"} <= names and "generate-3" not in names


def test_a_step_with_no_dataset_due_measures_the_delegate_alone(
    prefect_server: str, cpu_fleet: CpuFleet, tiny_model: Path, tmp_path: Path, skills: SkillsLike
) -> None:
    state, env = _point(tmp_path, cpu_fleet, tiny_model, f"{skills.url}/evaluate", 120, 6, every_n_steps=4)

    assert state.name == "Completed", state.message
    assert state.message == f"measured {env.run}/step-6: 6 delegate metrics (not due: arith_add)"
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert (row.dataset, row.state, row.weight_version) == (None, "measured", "6")
    delegated = {k: v for k, v in row.metrics.items() if k.startswith(("eval/aime25/", "eval/hle/"))}
    assert delegated == {
        "eval/aime25/pass@1": _pass_at_1(skills.texts["aime25"], 2), "eval/aime25/num_entries": 2.0,
        "eval/aime25/generations": 4.0,
        "eval/hle/pass@1": _pass_at_1(skills.texts["hle"], 1), "eval/hle/num_entries": 2.0,
        "eval/hle/generations": 2.0,
    }
    assert (row.metrics["eval/datasets_run"], row.metrics["eval/datasets_not_due"], row.metrics["eval/step"]) == (
        0.0, 1.0, 6.0)
    assert not [k for k in row.metrics if k.startswith("eval/arith_add")]
    assert json.loads(skills.bodies[0])["rollout_id"] == 6
    calls = SinksBlock.load(env.blocks["sinks"]).results_store().read(env.run, 6, DELEGATE_CALLS).to_pylist()
    assert [(c["route"], c["status"], c["weight_version"]) for c in calls] == [("/v1/chat/completions", 200, "6")] * 6
    with get_client(sync_client=True) as c:
        names = {t.name for t in c.read_task_runs() if t.flow_run_id == state.state_details.flow_run_id}
    assert {"pin-6", "delegate-6"} <= names and not {"generate-6", "cached-generations-6"} & names
    out = asyncio.run(_collect(prefect_server, env.run, str(state.state_details.flow_run_id), 6))
    assert (out.data, {k: v for k, v in out.metrics.items() if k.startswith(("eval/aime25/", "eval/hle/"))}) == (
        {}, delegated)
    [event] = settled_events(EVENT_MEASURED, point_resource(env.run, 6)["prefect.resource.id"])  # one, for the point
    assert event["payload"]["metrics"] == row.metrics


async def _collect(api_url: str, run: str, flow_run_id: str, step: int) -> Any:
    auth = PrefectApiSettings().api_auth_string  # the test server's credential, from the environment
    config = AdapterConfig(api_url=api_url, run=run, poll_interval_s=0.2, timeout_s=30, auth_string=auth)
    async with httpx.AsyncClient(timeout=30) as http:
        rest = PinnedEvalREST(config, http)
        return await collect_point(rest, await rest.wait(flow_run_id), step)


@pytest.mark.parametrize(
    ("path", "timeout", "why"),
    [
        ("/error", 120, "HTTP 503: 'overloaded' (after 1 attempt)"),
        ("/hang", 1, "no reply within 1 s (after 1 attempt)"),
        ("/garbage", 120, "reply is not JSON: b'<html>not json' (after 1 attempt)"),
    ],
)
def test_a_failing_delegate_skips_the_point_naming_it(
    prefect_server: str, cpu_fleet: CpuFleet, tiny_model: Path, tmp_path: Path, skills: SkillsLike,
    path: str, timeout: int, why: str,
) -> None:
    state, env = _point(tmp_path, cpu_fleet, tiny_model, f"{skills.url}{path}", timeout, 4)

    assert state.name == "Skipped", state.message
    assert state.message == f"delegate_failed: delegate 'skills' ({skills.url}{path}): {why}"
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert (row.state, row.reason, row.metrics["eval/skipped_delegate_failed"]) == ("skipped", "delegate_failed", 1.0)
    assert len(skills.bodies) == 1  # max_retries: 1 is one attempt, as in miles
    calls = SinksBlock.load(env.blocks["sinks"]).results_store().read(env.run, 4, DELEGATE_CALLS)
    assert calls.num_rows == 0  # written also for a failed delegate: this one made no model call
