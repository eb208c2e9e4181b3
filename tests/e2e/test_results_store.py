"""Samples kept, steps compared, generations cached and re-scored: through the real flow, the
session's Prefect server and CPU fleet (tests/pointkit.py)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
from prefect import get_client
from prefect.artifacts import Artifact
from typer.testing import CliRunner

from app.cli import app
from app.commands.results import demo_summary
from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.points import history_artifact_key
from pinned_eval.results.store import GENERATIONS, SAMPLES, ResultsStore
from pinned_eval.results.tables import is_rescored, table_key
from pinned_eval.sinks import JsonlSink
from tasks.results import samples_link_key
from tests.pointkit import SMALL_SUITE, CpuFleet, PointEnv, save_point_blocks, write_step_snapshot
from tests.rewards import text_parity
from tests.wandb_offline import logged_tables

pytestmark = pytest.mark.e2e


def _suite(reward: str):
    return SMALL_SUITE.model_copy(update={"defaults": SMALL_SUITE.defaults.model_copy(update={"reward": reward})})


PARITY = _suite("custom:tests.rewards:text_parity")
EXPLODE = _suite("custom:tests.rewards:explode")


def results_env(tmp_path: Path, cpu_fleet: CpuFleet, suite, **kw: object) -> tuple[PointEnv, ResultsStore]:
    fleet = FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, suite=suite, wandb=bool(kw))
    old = SinksBlock.load(env.blocks["sinks"])
    sinks = old.model_copy(update={"results_root": str(tmp_path / "results"), **kw})
    sinks.save(env.blocks["sinks"], overwrite=True)
    store = sinks.results_store()
    assert store is not None
    return env, store


def run_point(env: PointEnv, step: int, tiny: Path, **snap: object):
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)
    if not Path(dest).exists():
        write_step_snapshot(tiny, dest, **snap)  # type: ignore[arg-type]
    return eval_point(**env.params(step, source={"kind": "staged", "path": dest}), return_state=True)


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def engine_requests(fleet: CpuFleet) -> int:
    """Generate requests the fleet's engines finished (their own counters)."""
    total = 0
    for url in fleet.engine_urls:
        info = httpx.get(f"{url}/get_server_info", headers=fleet.headers(), timeout=10).json()
        total += info["internal_states"][0]["requests_finished"]
    return total


def test_points_keep_their_samples_and_compare_shows_the_flips(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path
) -> None:
    env, store = results_env(tmp_path, cpu_fleet, PARITY, wandb_samples_per_dataset=2)
    assert run_point(env, 1, tiny_model).name == "Completed"
    state = run_point(env, 2, tiny_model, scale=0.5, seed=3)
    assert state.name == "Completed", state.message

    rows = store.read(env.run, 2, SAMPLES).to_pylist()
    datasets = {ds.name: ds for ds in SMALL_SUITE.resolved()}
    assert sorted((r["dataset"], r["example_id"]) for r in rows) == [(d, i) for d in sorted(datasets) for i in range(6)]
    # the stored text is what the engines return for that prompt (the fleet still serves step 2)
    for r in rows:
        ds = datasets[r["dataset"]]
        params = {k: v for k, v in ds.sampling_params().items() if k != "stop"}
        out = httpx.post(f"{cpu_fleet.router_url}/generate", headers=cpu_fleet.headers(), timeout=60,
                         json={"text": r["prompt"], "sampling_params": params}).json()
        assert r["response"] == out["text"]
        assert (r["weight_version"], r["finish_reason"]) == ("2", out["meta_info"]["finish_reason"]["type"])
        assert (r["prompt_tokens"], r["completion_tokens"]) == (
            out["meta_info"]["prompt_tokens"], out["meta_info"]["completion_tokens"])
        assert r["reward"] == text_parity(r["response"], "")
        assert json.loads(r["label"]) == ds_label(ds.path, r["example_id"])
    # the JSONL rows are the metric rows they always were, and agree with the samples
    jsonl = {r.dataset: r for r in JsonlSink(env.jsonl).read(env.run) if r.step == 2}
    for ds in datasets:
        mine = [r["reward"] for r in rows if r["dataset"] == ds]
        assert jsonl[ds].metrics[f"eval/{ds}"] == pytest.approx(sum(mine) / len(mine))
        assert not any(k.startswith("eval/sink_failed") for k in jsonl[ds].metrics)

    # linked from the point's artifacts
    link = Artifact.get(samples_link_key(env.run, 2))
    assert link is not None and Path(store.url(env.run, 2, SAMPLES)).as_uri() in str(link.data)
    point = Artifact.get(f"{history_artifact_key(env.run)}-step-2")
    assert point is not None and store.link(env.run, 2, SAMPLES) in (point.description or "")
    # W&B: the first two samples of each dataset, as a table
    tables = logged_tables(tmp_path)
    for ds in datasets:
        mine = sorted((r for r in rows if r["dataset"] == ds), key=lambda r: r["example_id"])[:2]
        assert [row[:5] for row in tables[f"eval/samples/{ds}"]["data"]] == [
            [r["example_id"], r["sample_index"], r["prompt"], r["response"], r["reward"]] for r in mine
        ]

    # compare: the flips computed from the two steps' stored texts, each way
    a = {(r["dataset"], r["example_id"]): r for r in store.read(env.run, 1, SAMPLES).to_pylist()}
    b = {(r["dataset"], r["example_id"]): r for r in rows}
    lost = sorted(k for k in a if a[k]["reward"] == 1.0 and b[k]["reward"] == 0.0)
    gained = sorted(k for k in a if a[k]["reward"] == 0.0 and b[k]["reward"] == 1.0)
    assert lost and gained  # the two snapshots' generations flip both ways under this reward
    code, out = cli("compare", env.run, "1", "2", "--sinks", env.blocks["sinks"], "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert sorted((d["dataset"], f["example_id"]) for d in doc for f in d["lost"]) == lost
    assert sorted((d["dataset"], f["example_id"]) for d in doc for f in d["gained"]) == gained
    for d in doc:
        for f in d["lost"] + d["gained"]:
            key = (d["dataset"], f["example_id"])
            assert (f["response_a"], f["response_b"], f["prompt"]) == (a[key]["response"], b[key]["response"],
                                                                        a[key]["prompt"])
    code, text = cli("compare", env.run, "1", "2", "--sinks", env.blocks["sinks"])
    assert code == 0 and f"{len([k for k in lost if k[0] == 'arith_add'])} correct in A and wrong in B" in text

    # what the demo prints at its end: at most `limit` flips listed each way, and the samples file
    lines = demo_summary(env.run, 1, 2, env.blocks["sinks"], limit=1)
    assert lines[-1] == f"samples of step 2: {store.url(env.run, 2, SAMPLES)}"
    assert sum(line.startswith("  [correct in A, wrong in B]") for line in lines) == len({d for d, _ in lost})
    assert sum(line.startswith("  [wrong in A, correct in B]") for line in lines) == len({d for d, _ in gained})

    # the report's comparison section: the last two measured steps
    out_file = tmp_path / "report.html"
    code, out = cli("report", "--run", env.run, "--out", str(out_file), "--sinks", env.blocks["sinks"])
    assert code == 0, out
    page = out_file.read_text()
    assert "Step 1 (A) vs step 2 (B): examples that flipped" in page
    assert page.count("<table class='flips' data-flip='lost'>") == len({d for d, _ in lost})


def ds_label(path: Path, index: int) -> object:
    return json.loads(Path(path).read_text().splitlines()[index])["label"]


def test_a_rerun_after_a_scoring_failure_reuses_the_generations_and_rescore_needs_no_fleet(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path
) -> None:
    env, store = results_env(tmp_path, cpu_fleet, EXPLODE)
    state = run_point(env, 4, tiny_model)
    assert state.is_failed()
    assert store.exists(env.run, 4, GENERATIONS) and not store.exists(env.run, 4, SAMPLES)
    stored = store.read(env.run, 4, GENERATIONS).to_pylist()

    EvalSuiteBlock(suite=SMALL_SUITE).save(env.blocks["suite"], overwrite=True)  # the reward fixed
    before = engine_requests(cpu_fleet)
    state = run_point(env, 4, tiny_model)
    assert state.name == "Completed", state.message
    assert engine_requests(cpu_fleet) == before  # scored from the stored generations: no request
    samples = store.read(env.run, 4, SAMPLES).to_pylist()
    assert [r["response"] for r in samples] == [r["response"] for r in stored]
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(state.state_details.flow_run_id)
        names = {t.name for t in c.read_task_runs() if t.flow_run_id == fr.id}
    assert "cached-generations-4" in names and not any(n.startswith(("generate-", "pin")) for n in names)

    # rescore with another reward: the suite block's, no fleet block named, no request
    EvalSuiteBlock(suite=PARITY).save(env.blocks["suite"], overwrite=True)
    measured = {r.dataset: r for r in JsonlSink(env.jsonl).read(env.run)}
    FleetBlock(name="gone", mode="launch", state_file=str(tmp_path / "no-fleet.json")).save(
        env.blocks["fleet"], overwrite=True
    )  # the point's fleet block now names no fleet at all
    code, out = cli("rescore", env.run, "4", "--suite", env.blocks["suite"], "--sinks", env.blocks["sinks"])
    assert code == 0, out
    assert engine_requests(cpu_fleet) == before
    table = store.read(env.run, 4, SAMPLES)
    assert is_rescored(table)
    assert [r["reward"] for r in table.to_pylist()] == [text_parity(r["response"], "") for r in stored]
    rows = {r.dataset: r for r in JsonlSink(env.jsonl).read(env.run)}
    for ds, row in rows.items():
        mine = [text_parity(r["response"], "") for r in stored if r["dataset"] == ds]
        assert row.metrics[f"eval/{ds}"] == pytest.approx(sum(mine) / len(mine))
        assert row.metrics["eval/rescored"] == 1.0
        assert row.metrics["eval/duration_seconds"] == measured[ds].metrics["eval/duration_seconds"]
        assert f"{ds}: eval/{ds}={sum(mine) / len(mine):.4f} (rescored)" in out


def test_other_generation_parameters_are_a_cache_miss(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path
) -> None:
    env, store = results_env(tmp_path, cpu_fleet, SMALL_SUITE)
    assert run_point(env, 5, tiny_model).name == "Completed"
    first = table_key(store.read(env.run, 5, GENERATIONS))
    longer = SMALL_SUITE.model_copy(update={"defaults": SMALL_SUITE.defaults.model_copy(update={"max_new_tokens": 4})})
    EvalSuiteBlock(suite=longer).save(env.blocks["suite"], overwrite=True)
    before = engine_requests(cpu_fleet)
    assert run_point(env, 5, tiny_model).name == "Completed"
    assert engine_requests(cpu_fleet) - before >= 12  # generated anew (the cached rerun above sends none)
    table = store.read(env.run, 5, GENERATIONS)
    assert table_key(table) not in (None, first)  # rewritten under the new key
    assert {r["dataset"] for r in table.to_pylist()} == {"arith_add", "arith_sub"}


def test_a_results_store_that_cannot_be_written_is_a_failed_sink_not_a_failed_point(
    prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path, tiny_model: Path
) -> None:
    env, _ = results_env(tmp_path, cpu_fleet, SMALL_SUITE)
    (tmp_path / "results").write_text("a file where the results directory should be")
    state = run_point(env, 6, tiny_model)
    assert state.name == "Completed" and "sink failed: results" in state.message
    for row in JsonlSink(env.jsonl).read(env.run):
        assert row.state == "measured" and row.metrics["eval/sink_failed_results"] == 1.0
        assert "results" in row.sink_errors


def test_compare_and_rescore_refuse_what_they_cannot_read(prefect_server: str, tmp_path: Path) -> None:
    from pinned_eval.results.tables import generation_row, generations_table, samples_table

    SinksBlock(jsonl_path=str(tmp_path / "m.jsonl")).save("no-results-store", overwrite=True)
    code, out = cli("compare", "exp", "1", "2", "--sinks", "no-results-store")
    assert code == 1 and "sets no results_root" in out
    sinks = SinksBlock(jsonl_path=str(tmp_path / "m.jsonl"), results_root=str(tmp_path / "results"))
    sinks.save("a-results-store", overwrite=True)
    store = sinks.results_store()
    assert store is not None
    gen = {"dataset": "elsewhere", "prompt_index": 0, "sample_index": 0, "prompt": "1+1=", "label": "2",
           "metadata": {}, "response": "2", "response_len": 1, "finish_reason": "stop",
           "weight_version": "1"}
    store.write("exp", 1, SAMPLES, samples_table([{**generation_row(gen), "reward": 1.0}], key=None))
    store.write("exp", 1, GENERATIONS, generations_table([generation_row(gen)], "k"))
    code, out = cli("compare", "exp", "1", "2", "--sinks", "a-results-store")
    assert code == 1 and "no samples.parquet for exp step 2" in out
    EvalSuiteBlock(suite=SMALL_SUITE).save("small-suite", overwrite=True)
    code, out = cli("rescore", "exp", "1", "--suite", "small-suite", "--sinks", "a-results-store")
    assert code == 2 and "has no dataset elsewhere" in out
    code, out = cli("rescore", "exp", "3", "--suite", "small-suite", "--sinks", "a-results-store")
    assert code == 1 and "no generations.parquet for exp step 3" in out


@pytest.mark.parametrize("refusal", ["another_points_file", "world_writable_step_dir"])
def test_report_and_demo_summary_turn_a_refused_results_file_into_one_line(
    prefect_server: str, tmp_path: Path, refusal: str
) -> None:
    """`report --sinks` (`last_two_compared`) and the demo's summary read the store like `compare`:
    a file written for another point (`ResultsKeyError`) or a step directory others may write
    (`UntrustedPathError`) is one line naming it, never a traceback."""
    import os
    import shutil

    from app.commands._cli import CliError
    from app.commands.results import last_two_compared
    from app.history import PointHistory, RunHistory
    from pinned_eval.results.tables import generation_row, samples_table

    name = f"refused-{uuid.uuid4().hex[:6]}"
    sinks = SinksBlock(jsonl_path=str(tmp_path / "m.jsonl"), results_root=str(tmp_path / "results"))
    sinks.save(name)
    store = sinks.results_store()
    assert store is not None
    gen = {"dataset": "d", "prompt_index": 0, "sample_index": 0, "prompt": "1+1=", "label": "2",
           "metadata": {}, "response": "2", "response_len": 1, "finish_reason": "stop", "weight_version": "1"}
    for step in (1, 2):
        store.write("exp", step, SAMPLES, samples_table([{**generation_row(gen), "reward": 1.0}], key=None))
    one, two = Path(store._dir("exp", 1)), Path(store._dir("exp", 2))
    if refusal == "another_points_file":
        shutil.copyfile(two / SAMPLES, one / SAMPLES)  # step 2's samples where step 1's belong
        expected = f"{one / SAMPLES} was not written for exp step 1 (it names "
    else:
        os.chmod(two, 0o777)  # a neighbour could swap the file: the store refuses the whole path
        expected = f"results file {str(two / SAMPLES)!r} refused"
    history = RunHistory(run="exp", points=[PointHistory(run="exp", step=s, outcome="measured") for s in (1, 2)])

    with pytest.raises(CliError) as info:
        last_two_compared(history, name)
    assert info.value.code == 1 and info.value.message.startswith(f"--sinks: {expected}"), info.value.message
    assert "\n" not in info.value.message
    [line] = demo_summary("exp", 1, 2, name)
    assert line.startswith(f"samples not compared: {expected}"), line
