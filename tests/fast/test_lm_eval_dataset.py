"""lm-eval tasks as a dataset (`kind: lm_eval`): what a suite accepts and refuses when it loads,
the dataset's rows (one per task, keyed by the task files), the metric keys, and the child's
refusal of an unknown task. The measured point is tests/e2e/test_lm_eval_point.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pinned_eval.datasets.loader import load_dataset
from pinned_eval.harness import extra
from pinned_eval.rollout.lm_eval import _samples, child_env, child_request, lm_eval_metrics, model_args
from pinned_eval.rollout.types import Sample
from pinned_eval.suite import DatasetSpec, EvalSuite, ResolvedDataset

TASKS = Path(__file__).parent.parent / "data" / "lm_eval_tasks"


def _lm(**kw: object) -> DatasetSpec:
    return DatasetSpec(name="lm", kind="lm_eval", **kw)  # type: ignore[arg-type]


def test_a_suite_needing_lm_eval_without_it_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extra, "find_spec", lambda name: None if name == "lm_eval" else object())
    with pytest.raises(ValidationError) as err:
        _lm(tasks=("pe_arith_gen",))
    assert "dataset 'lm' (kind: lm_eval): needs lm-eval, not installed (missing ['lm_eval']): " \
           "pip install 'pinned-eval[harness]'" in str(err.value)
    yaml = "eval:\n  datasets:\n    - name: lm\n      kind: lm_eval\n      tasks: [pe_arith_gen]\n"
    with pytest.raises(ValueError, match=r"pip install 'pinned-eval\[harness\]'"):
        EvalSuite.from_miles_yaml(yaml)
    DatasetSpec(name="rows", path="builtin:arith_add.jsonl")  # a suite without lm-eval datasets still loads


@pytest.mark.parametrize(("fields", "message"), [
    ({"kind": "rows"}, "path: required (a JSONL or Parquet file)"),
    ({"kind": "rows", "path": "a.jsonl", "tasks": ("t",)}, "tasks: only for kind: lm_eval"),
    ({"kind": "rows", "path": "a.jsonl", "task_dir": "t"}, "task_dir: only for kind: lm_eval"),
    ({"kind": "rows", "path": "a.jsonl", "num_fewshot": 0}, "num_fewshot: only for kind: lm_eval"),
    ({"kind": "lm_eval"}, "tasks: required for kind: lm_eval (lm-eval task names)"),
    ({"kind": "lm_eval", "tasks": ("t",), "path": "a.jsonl"}, "path: not used by kind: lm_eval"),
    ({"kind": "lm_eval", "tasks": ("t",), "generate_function": "m.f"}, "generate_function: not used by kind: lm_eval"),
    ({"kind": "lm_eval", "tasks": ("a/b",)}, "String should match pattern"),
])
def test_bad_lm_eval_fields_are_refused_by_name(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        DatasetSpec(name="d", **fields)  # type: ignore[arg-type]


def test_a_miles_yaml_lm_eval_dataset_needs_no_rm_type_and_is_an_extension_key() -> None:
    yaml = (f"eval:\n  datasets:\n    - name: lm\n      kind: lm_eval\n      tasks: [pe_arith_gen, pe_colour_mc]\n"
            f"      task_dir: {TASKS}\n      num_fewshot: 0\n      max_prompts: 3\n")
    (ds,) = EvalSuite.from_miles_yaml(yaml).resolved()
    assert (ds.rollout, ds.tasks, ds.task_dir, ds.num_fewshot, ds.max_prompts, ds.path) == (
        "lm_eval", ("pe_arith_gen", "pe_colour_mc"), TASKS, 0, 3, None)
    with pytest.raises(ValueError, match=r"eval.datasets\[0\].kind: a pinned-eval extension miles does not read"):
        EvalSuite.from_miles_yaml(yaml, strict_miles=True)


def test_a_relative_task_dir_resolves_against_the_yaml_file(tmp_path: Path) -> None:
    yaml = "eval:\n  datasets:\n    - {name: lm, kind: lm_eval, tasks: [t], task_dir: tasks}\n"
    (tmp_path / "eval.yaml").write_text(yaml)
    (ds,) = EvalSuite.from_miles_yaml(tmp_path / "eval.yaml").resolved()
    assert ds.task_dir == tmp_path / "tasks"


def test_rows_are_one_per_task_keyed_by_the_task_files(tmp_path: Path) -> None:
    for f in TASKS.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    suite = EvalSuite(datasets=(_lm(tasks=("pe_arith_gen", "pe_colour_mc"), task_dir=str(tmp_path)),))
    rows = load_dataset(suite.resolved()[0])
    assert [(r.index, r.prompt) for r in rows] == [(0, "pe_arith_gen"), (1, "pe_colour_mc")]
    before = rows[0].label
    with (tmp_path / "arith_gen.jsonl").open("a") as fh:
        fh.write(json.dumps({"question": "What is 1+1?", "answer": "2"}) + "\n")
    assert load_dataset(suite.resolved()[0])[0].label != before  # a changed data file: another cache key
    missing = EvalSuite(datasets=(_lm(tasks=("t",), task_dir=str(tmp_path / "nope")),))
    with pytest.raises(ValueError, match=r"dataset 'lm': task_dir .*nope is not a directory"):
        load_dataset(missing.resolved()[0])


def _sample(task: str, results: dict[str, object]) -> Sample:
    return Sample(dataset="lm", prompt_index=0, sample_index=0, prompt="p", label="l", response="r",
                  response_len=0, finish_reason=None, weight_version="1",
                  metadata={"lm_eval_task": task, "lm_eval_results": results})


def test_metric_keys_are_lm_evals_own_numbers_per_task() -> None:
    samples = [
        _sample("gen", {"alias": "gen", "sample_len": 24, "exact_match,none": 0.25, "exact_match_stderr,none": 0.1,
                        "exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": "N/A"}),
        _sample("mc", {"acc,none": 1, "acc_stderr,none": 0.0}),
    ]
    assert lm_eval_metrics(samples) == {
        "eval/gen/exact_match": 0.25, "eval/gen/exact_match_stderr": 0.1,
        "eval/gen/exact_match/flexible-extract": 0.5, "eval/mc/acc": 1.0, "eval/mc/acc_stderr": 0.0}


def test_model_args_point_lm_eval_at_the_gateway_with_text_prompts() -> None:
    assert model_args("local-completions", "http://127.0.0.1:9", "/snap", 4) == {
        "model": "default", "base_url": "http://127.0.0.1:9/v1/completions", "num_concurrent": 4, "max_retries": 1,
        "tokenizer_backend": "huggingface", "tokenizer": "/snap", "tokenized_requests": False}
    assert model_args("local-chat-completions", "http://g", None, 1) == {
        "model": "default", "base_url": "http://g/v1/chat/completions", "num_concurrent": 1, "max_retries": 1}


def test_the_child_request_maps_the_dataset_and_runs_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    suite = EvalSuite(datasets=(_lm(tasks=("pe_arith_gen",), task_dir=str(TASKS), max_prompts=5, num_fewshot=2),))
    req = child_request(suite.resolved()[0], "http://gw", "/snap", 3, tmp_path / "o.json")
    assert req == {"model": "local-completions", "model_args": model_args("local-completions", "http://gw", "/snap", 3),
                   "tasks": ["pe_arith_gen"], "include_path": str(TASKS), "limit": 5, "num_fewshot": 2,
                   "out": str(tmp_path / "o.json")}
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setenv("OPENAI_API_KEY", "the worker's own key")
    env = child_env("gateway-token", tmp_path)
    assert {k: env[k] for k in ("OPENAI_API_KEY", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_CACHE")} == {
        "OPENAI_API_KEY": "gateway-token", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")}


def test_the_child_refuses_an_unknown_task_before_any_request(tmp_path: Path) -> None:
    req = {"model": "local-completions", "model_args": {"base_url": "http://127.0.0.1:9/v1/completions"},
           "tasks": ["pe_arith_gen", "no_such_task"], "include_path": str(TASKS), "out": str(tmp_path / "o.json")}
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "pinned_eval.harness.lm_eval_child"], input=json.dumps(req),
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"tasks: unknown lm-eval task(s) ['no_such_task'] (task_dir {TASKS})"
    assert not (tmp_path / "o.json").exists()


def _child(req: dict[str, object], cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    return subprocess.run([sys.executable, "-m", "pinned_eval.harness.lm_eval_child"], input=json.dumps(req),
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=180)


def _dummy(ds: ResolvedDataset, tmp_path: Path) -> dict[str, object]:
    """The child's request for `ds` with lm-eval's own `dummy` model (no server)."""
    return child_request(ds, "http://unused", None, 1, tmp_path / "o.json") | {"model": "dummy", "model_args": {}}


def test_groups_nested_groups_and_tags_are_lm_evals_own_aggregates(tmp_path: Path) -> None:
    """lm-eval's own run (its `dummy` model: no server) of a group holding the group pe_mixed, of a
    tag and of a group without aggregate_metric_list: each named group's and nested group's
    aggregates are `eval/<group>/...` exactly as lm-eval's `groups` entries give them, the group
    without aggregates has none; a group's and a tag's rows hold their tasks' samples."""
    for f in TASKS.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "outer.yaml").write_text("group: pe_outer\ntask: [pe_mixed]\n"
                                         "aggregate_metric_list: [{metric: acc}]\n")
    (tmp_path / "tagged.yaml").write_text("include: arith_gen.yaml\ntask: pe_arith_tagged\ntag: pe_tag\n")
    (tmp_path / "plain_task.yaml").write_text("include: arith_gen.yaml\ntask: pe_arith_plain\n")
    (tmp_path / "plain.yaml").write_text("group: pe_plain\ntask: [pe_arith_plain]\n")
    suite = EvalSuite(datasets=(_lm(tasks=("pe_outer", "pe_tag", "pe_plain"), task_dir=str(tmp_path), max_prompts=3),))
    (ds,) = suite.resolved()
    done = _child(_dummy(ds, tmp_path), tmp_path, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "o.json").read_text())
    assert set(result["groups"]) == {"pe_outer", "pe_mixed"}  # type: ignore[arg-type]

    by_row = _samples(ds, result, "5")

    assert [(s.prompt_index, s.metadata["lm_eval_task"]) for s in by_row["pe_outer"]] == [
        (i, t) for i, t in enumerate(t for t in ("pe_arith_gen", "pe_colour_mc", "pe_colour_mc_qa") for _ in range(3))]
    assert [(s.prompt_index, s.metadata["lm_eval_task"]) for s in by_row["pe_tag"]] == [
        (9, "pe_arith_tagged"), (10, "pe_arith_tagged"), (11, "pe_arith_tagged")]
    assert [s.metadata["lm_eval_task"] for s in by_row["pe_plain"]] == ["pe_arith_plain"] * 3
    assert "lm_eval_groups" not in by_row["pe_plain"][0].metadata
    groups = result["groups"]
    assert isinstance(groups, dict)
    mixed, outer = groups["pe_mixed"], groups["pe_outer"]
    got = lm_eval_metrics([s for rows in by_row.values() for s in rows])
    assert {k: v for k, v in got.items() if k.startswith(("eval/pe_mixed/", "eval/pe_outer/"))} == {
        "eval/pe_mixed/exact_match": mixed["exact_match,none"],
        "eval/pe_mixed/exact_match_stderr": mixed["exact_match_stderr,none"],
        "eval/pe_mixed/acc": mixed["acc,none"], "eval/pe_mixed/acc_stderr": mixed["acc_stderr,none"],
        "eval/pe_mixed/acc_norm": mixed["acc_norm,none"],
        "eval/pe_mixed/acc_norm_stderr": mixed["acc_norm_stderr,none"],
        "eval/pe_outer/acc": outer["acc,none"], "eval/pe_outer/acc_stderr": outer["acc_stderr,none"]}
    results = result["results"]
    assert isinstance(results, dict)
    colour, qa = results["pe_colour_mc"], results["pe_colour_mc_qa"]
    assert got["eval/pe_mixed/acc"] == pytest.approx((colour["acc,none"] + qa["acc,none"]) / 2)  # by size: 3 and 3
    assert got["eval/pe_colour_mc_qa/acc"] == qa["acc,none"]
    assert got["eval/pe_arith_tagged/exact_match"] == results["pe_arith_tagged"]["exact_match,none"] == 0.0
    assert "eval/pe_arith_plain/exact_match" in got and not [k for k in got if k.startswith("eval/pe_plain/")]


def test_a_task_named_twice_directly_and_through_its_group_is_lm_evals_duplicate_error(tmp_path: Path) -> None:
    suite = EvalSuite(datasets=(_lm(tasks=("pe_mixed", "pe_arith_gen"), task_dir=str(TASKS), max_prompts=1),))
    done = _child(_dummy(suite.resolved()[0], tmp_path), TASKS, tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ValueError: Duplicate task 'pe_arith_gen': found in both 'pe_mixed' and 'pe_arith_gen'")
