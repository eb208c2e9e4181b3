"""lm-eval tasks as a dataset of a point, as a real Prefect flow run: 2 CPU engines (scripted
answers for some generation prompts) behind the real sglang-router, the suite's dataset naming a
local generation task and a local multiple-choice task (tests/data/lm_eval_tasks: YAML + JSONL).

- the point's dataset names the local group `pe_mixed` (its three tasks): its `eval/<task>/<metric>`,
  the group's `eval/pe_mixed/<metric>` and their stderr equal lm-eval's own run (`simple_evaluate`
  in a fresh process, no pinned-eval code) against the same engines, exactly (its `results` and
  `groups`); every sample is at the pinned version and lm-eval's per-sample record is in the
  point's samples file;
- lm-eval's requests count in the point's budget: a used-up `agent_max_requests` is
  `agent_budget`;
- the rollout on the same engines (no flow): `local-chat-completions` measures the generation task
  through the gateway's chat route; a reply of other weights fails it with the gateway's
  `WeightVersionMismatch` (`pin_violation`) and leaves no lm-eval process behind; an unknown task
  is the skip `harness_error` naming it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from blocks import SinksBlock
from pinned_eval.datasets.loader import load_dataset
from pinned_eval.fleet.errors import WeightVersionMismatch
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.fleet.launcher import LaunchedFleet
from pinned_eval.results.store import SAMPLES
from pinned_eval.rollout import PointSession, Sample, run_rollouts
from pinned_eval.rollout.lm_eval import lm_eval_metrics
from pinned_eval.sinks import JsonlSink
from pinned_eval.skips import EvalSkipped
from pinned_eval.suite import DatasetSpec, EvalSuite
from tests.pointkit import launched_point_env, run_staged_point, scripted_fleet

pytestmark = pytest.mark.e2e
TASKS = Path(__file__).parent.parent / "data" / "lm_eval_tasks"
GEN_ROWS = [json.loads(line) for line in (TASKS / "arith_gen.jsonl").read_text().splitlines()]
SCRIPTED = GEN_ROWS[:5]  # the engines answer these questions right (greedy decoding answers none)
RULES = [{"prompt_contains": f"Q: {r['question']}\nA:", "completion": r["answer"]} for r in SCRIPTED]

# lm-eval's own run against the router, without pinned-eval: the same model and tasks
DIRECT = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
req = json.loads(sys.argv[1])
out = simple_evaluate(model="local-completions", model_args=req["model_args"], tasks=req["tasks"],
                      task_manager=TaskManager(include_path=".", include_defaults=False), log_samples=False)
print(json.dumps({"results": out["results"], "groups": out["groups"]}))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model
    from tests.pointkit import SESSION_ROOTS

    SESSION_ROOTS.append(str(tmp_path_factory.getbasetemp()))
    return make_tiny_model(tmp_path_factory.mktemp("lm") / "m", arch="llama", seed=0, chat_template="chatml")


@pytest.fixture(scope="module")
def fleet(model: Path) -> Iterator[LaunchedFleet]:
    with scripted_fleet(model, RULES) as launched:
        yield launched


_env = launched_point_env
_run = run_staged_point


def _suite(tasks: tuple[str, ...] = ("pe_arith_gen", "pe_colour_mc"), **fields: object) -> EvalSuite:
    ds = DatasetSpec(name="bench", kind="lm_eval", tasks=tasks, task_dir=str(TASKS), **fields)  # type: ignore[arg-type]
    return EvalSuite(datasets=(ds,))


def _served(fleet: LaunchedFleet) -> str:
    assert fleet.router_url is not None and fleet.keys is not None
    reply = httpx.post(f"{fleet.router_url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                       headers={"Authorization": f"Bearer {fleet.keys.api}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["meta_info"]["weight_version"])


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "pinned_eval.harness.lm_eval_child" in " ".join(p.cmdline())]


async def _rollout(fleet: LaunchedFleet, model: Path, expected: str, suite: EvalSuite) -> list[Sample]:
    assert fleet.router_url is not None and fleet.keys is not None
    (ds,) = suite.resolved()
    async with httpx.AsyncClient(timeout=60) as http:
        gen = RouterGenerator(http, fleet.router_url, api_key=fleet.keys.api)
        session = PointSession(gen, expected_version=expected, rid_prefix="t", tokenizer_dir=str(model))
        return await run_rollouts(session, [ds], {ds.name: load_dataset(ds)})


def _direct(fleet: LaunchedFleet, model: Path) -> dict[str, dict[str, dict[str, float]]]:
    assert fleet.router_url is not None and fleet.keys is not None
    args = {"model": "default", "base_url": f"{fleet.router_url}/v1/completions", "num_concurrent": 2,
            "max_retries": 1, "tokenizer_backend": "huggingface", "tokenizer": str(model), "tokenized_requests": False}
    env = {**os.environ, "OPENAI_API_KEY": fleet.keys.api, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(model.parent / "hf-direct")}
    done = subprocess.run([sys.executable, "-c", DIRECT, json.dumps({"model_args": args,
                                                                     "tasks": ["pe_mixed"]})],
                          cwd=TASKS, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_lm_eval_tasks_score_as_lm_eval_itself_on_the_pinned_fleet(
    prefect_server: str, fleet: LaunchedFleet, model: Path, tmp_path: Path
) -> None:
    env = _env(tmp_path, fleet, _suite(("pe_mixed",)))

    state = _run(env, 7, model)

    assert state.name == "Completed", state.message
    (row,) = JsonlSink(env.jsonl).read(env.run)
    got = {k: v for k, v in row.metrics.items() if k.startswith("eval/pe_") and not k.startswith("eval/pe_mixed/")}
    direct = _direct(fleet, model)  # after the point: the fleet still serves step 7's weights
    results, group = direct["results"], direct["groups"]["pe_mixed"]
    assert got == {
        "eval/pe_arith_gen/exact_match": results["pe_arith_gen"]["exact_match,none"],
        "eval/pe_arith_gen/exact_match_stderr": results["pe_arith_gen"]["exact_match_stderr,none"],
        **{f"eval/{t}/{m}": results[t][f"{m},none"] for t in ("pe_colour_mc", "pe_colour_mc_qa")
           for m in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")},
    }
    assert {k: v for k, v in row.metrics.items() if k.startswith("eval/pe_mixed/")} == {
        f"eval/pe_mixed/{m}": group[f"{m},none"] for m in (
            "exact_match", "exact_match_stderr", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr")}
    mc = [got[f"eval/{t}/acc_norm"] for t in ("pe_colour_mc", "pe_colour_mc_qa")]
    assert row.metrics["eval/pe_mixed/acc_norm"] == pytest.approx(sum(mc) / 2)  # the group averages its two tasks
    right = sum(r["question"] in {s["question"] for s in SCRIPTED} for r in GEN_ROWS)
    assert got["eval/pe_arith_gen/exact_match"] == right / len(GEN_ROWS)
    assert (row.state, row.weight_version, row.metrics["eval/bench/weight_version/mixed_version_ratio"]) == (
        "measured", "7", 0.0)
    samples = SinksBlock.load(env.blocks["sinks"]).results_store().read(env.run, 7, SAMPLES).to_pylist()
    assert len(samples) == 72 and {s["weight_version"] for s in samples} == {"7"}
    first = json.loads(samples[0]["metadata"])
    assert (first["lm_eval_task"], first["lm_eval"]["doc"], first["lm_eval"]["target"]) == (
        "pe_arith_gen", GEN_ROWS[0], SCRIPTED[0]["answer"])
    assert (samples[0]["response"], samples[0]["reward"]) == (SCRIPTED[0]["answer"], 1.0)
    mc = json.loads(samples[24]["metadata"])["lm_eval"]
    assert mc["doc_id"] == 0 and len(mc["filtered_resps"]) == 4  # four choices' loglikelihoods


def test_lm_eval_requests_count_in_the_point_budget(
    prefect_server: str, fleet: LaunchedFleet, model: Path, tmp_path: Path
) -> None:
    state = _run(_env(tmp_path, fleet, _suite(agent_max_requests=5)), 8, model)
    assert state.name == "Skipped", state.message
    assert state.message.startswith("agent_budget: the point's max_requests (5) is used up"), state.message


def test_a_reply_of_other_weights_fails_the_lm_eval_run_as_the_gateways_violation(
    fleet: LaunchedFleet, model: Path
) -> None:
    with pytest.raises(WeightVersionMismatch):
        asyncio.run(_rollout(fleet, model, "not-served", _suite()))
    assert _children() == []


def test_local_chat_completions_measures_a_generation_task_through_the_chat_route(
    fleet: LaunchedFleet, model: Path
) -> None:
    version = _served(fleet)
    samples = asyncio.run(_rollout(fleet, model, version, _suite(("pe_arith_gen",),
                                                                  lm_eval_model="local-chat-completions")))
    right = sum(r["question"] in {s["question"] for s in SCRIPTED} for r in GEN_ROWS)
    assert lm_eval_metrics(samples)["eval/pe_arith_gen/exact_match"] == right / len(GEN_ROWS)
    assert {s.weight_version for s in samples} == {version} and len(samples) == len(GEN_ROWS)
    assert json.loads(samples[0].prompt) == [{"role": "user", "content": f"Q: {GEN_ROWS[0]['question']}\nA:"}]
    assert samples[0].response == SCRIPTED[0]["answer"]


def test_an_unknown_task_is_the_skip_harness_error_naming_it(fleet: LaunchedFleet, model: Path) -> None:
    with pytest.raises(EvalSkipped) as skipped:
        asyncio.run(_rollout(fleet, model, "0", _suite(tasks=("pe_arith_gen", "no_such_task"))))
    assert (skipped.value.reason, skipped.value.message) == (
        "harness_error", f"dataset 'bench': lm-eval failed (exit 2): tasks: unknown lm-eval task(s) "
                         f"['no_such_task'] (task_dir {TASKS})")
