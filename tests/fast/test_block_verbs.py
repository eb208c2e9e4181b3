"""`pinned-eval block save|apply` and `pinned-eval init` refusals, before any server is contacted:
every message names the flag (or `FILE: section.key`), exit 2; `init` writes a config that
builds all four blocks and never overwrites."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.block_specs import build_block
from app.cli import app
from app.commands.init import load_project_config
from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return tmp_path


@pytest.mark.parametrize(("args", "message"), [
    (["suite", "default"], "--dataset: give the datasets either as --dataset NAME=PATH (repeatable) or in a "
                           "miles-style eval YAML (--from-yaml FILE), not both"),
    (["suite", "default", "--dataset", "d.jsonl"],
     "--dataset: 'd.jsonl': expected NAME=PATH, e.g. mytask=data/mytask.jsonl"),
    (["suite", "default", "--dataset", "t=nope.jsonl"], "--dataset: dataset 't': {tmp}/nope.jsonl: no such file"),
    (["suite", "default", "--dataset", "my task=d.jsonl"], "--dataset: 'my task=d.jsonl': dataset name 'my task': "
                                                           "letters, digits, '_', '.' and '-', starting with a letter "
                                                           "or digit"),
    (["suite", "default", "--dataset", "t=d.jsonl", "--temperature", "-1"],
     "--temperature: Input should be greater than or equal to 0 (got -1.0)"),
    (["suite", "default", "--dataset", "t=d.jsonl", "--reward", "bogus"],
     "--reward: reward 'bogus': unknown (use one of ['boxed_dapo', 'boxed_f1', 'boxed_gpqa', 'boxed_math', 'dapo', "
     "'deepscaler', 'exact_match', 'f1', 'gemma_math', 'gpqa', 'math', 'remote_rm'] or 'custom:<module:function>') "
     "(got 'bogus')"),
    (["suite", "default", "--dataset", "t=d.jsonl", "--rm-type", "math"],
     "--rm-type: applies to --from-yaml only (use --reward with --dataset)"),
    (["suite", "default", "--from-yaml", "e.yaml", "--max-new-tokens", "4"],
     "--max-new-tokens: set it in the eval YAML (eval.defaults or a dataset), not next to --from-yaml"),
    (["suite", "default", "--from-yaml", "e.yaml"], "--from-yaml: {tmp}/e.yaml: no such file"),
    (["suite", "Exp42", "--dataset", "t=d.jsonl"], "NAME: 'Exp42' is not a block name: lowercase letters, digits "
                                                   "and dashes, starting with a letter or digit (e.g. default, exp42)"),
    (["fleet", "default"], "--attach: give --attach ENGINE_URL (repeatable, with --router URL) for running engines, "
                           "or --launch for a fleet `pinned-eval fleet up` starts"),
    (["fleet", "default", "--attach", "http://127.0.0.1:1"], "--router: --attach needs the sglang-router URL in "
                                                             "front of the engines"),
    (["fleet", "default", "--attach", "127.0.0.1:1", "--router", "http://127.0.0.1:2"],
     "--attach: '127.0.0.1:1' is not an http(s):// URL"),
    (["fleet", "default", "--launch", "--router", "http://127.0.0.1:2"],
     "--router: applies to --attach only (a launched fleet's router is in its state file)"),
    (["fleet", "default", "--launch", "--backend", "tpu"], "--backend: Input should be 'cpu' or 'sglang' (got 'tpu')"),
    (["fleet", "default", "--launch", "--lock", "Big"], "--lock: 'Big': lowercase letters, digits and dashes (it "
                                                        "names the pin lock fleet-<lock>)"),
    (["fleet", "default", "--launch", "--engines", "0"],
     "--engines: Input should be greater than or equal to 1 (got 0)"),
    (["staging", "default", "--root", "st", "--keep", "-1"],
     "--keep: Input should be greater than or equal to 0 (got -1)"),
    (["staging", "default", "--root", "st", "--cache-max-size", "lots"],
     "--cache-max-size: 'lots' is not a size like 10GB, 512MiB or 1000000"),
    (["sinks", "default", "--wandb-project", "p", "--wandb-writer", "shared"],
     "--wandb-writer: 'shared' writes into the live training run: it needs --wandb-mode online"),
    (["sinks", "default", "--wandb-mode", "loud"],
     "--wandb-mode: Input should be 'online', 'offline' or 'disabled' (got 'loud')"),
    (["sinks", "default", "--results-root", "r", "--wandb-samples-per-dataset", "-1"],
     "--wandb-samples-per-dataset: Input should be greater than or equal to 0 (got '-1')"),
    (["sinks", "default", "--results-root", "r", "--wandb-samples-per-dataset", "1001"],
     "--wandb-samples-per-dataset: Input should be less than or equal to 1000 (got '1001')"),
    (["sinks", "default", "--results-root", "r", "--wandb-samples-per-dataset", "many"],
     "--wandb-samples-per-dataset: not a whole number from 0 to 1000 (got 'many')"),
    (["sinks", "default", "--results-root", "r", "--wandb-samples-per-dataset", "2.5"],
     "--wandb-samples-per-dataset: not a whole number from 0 to 1000 (got '2.5')"),
    (["sinks", "default", "--wandb-samples-per-dataset", "4"],
     "--wandb-samples-per-dataset: needs a results root (results_root or results_s3_bucket_block): the W&B table "
     "is read from the point's kept samples"),
    (["sinks", "default", "--mlflow-samples-per-dataset", "+3"],
     "--mlflow-samples-per-dataset: not a whole number from 0 to 1000 (got '+3')"),
])
def test_save_refusals_name_the_flag(data: Path, args: list[str], message: str) -> None:
    code, out = cli("block", "save", *args)
    assert (code, out.strip()) == (2, "error: " + message.format(tmp=data)), out


def test_key_files_must_be_private(data: Path) -> None:
    key = data / "key"
    key.write_text("sekrit\n")
    key.chmod(0o644)
    code, out = cli("block", "save", "fleet", "default", "--launch", "--api-key-file", str(key))
    assert (code, out.strip()) == (2, f"error: --api-key-file: {key}: the API credential file must be a regular "
                                      "file of mode 0600, not -rw-r--r--")


def test_s3_keys_come_from_the_environment_only(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    code, out = cli("block", "save", "staging", "default", "--root", "s3://b/p", "--s3-keys-from-env")
    assert (code, out.strip()) == (2, "error: --s3-keys-from-env: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY not "
                                      "set in this environment")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    block = build_block("staging", {"root": "s3://b/p", "s3_keys_from_env": True}, data, "x")
    assert isinstance(block, StagingBlock) and block.s3_options()["secret"] == "s3cr3t"


def test_flags_build_the_blocks_a_python_user_would_save(data: Path) -> None:
    key = data / "admin"
    key.write_text("adm\n")
    key.chmod(0o600)
    suite = build_block("suite", {"dataset": ["t=d.jsonl", "add=builtin:arith_add.jsonl"], "reward": "exact_match",
                                  "max_new_tokens": 3, "temperature": 0.0, "stop": ["\n"], "point_timeout": 60}, data,
                        "default")
    assert isinstance(suite, EvalSuiteBlock) and suite.point_timeout_seconds == 60
    [t, add] = suite.resolved()
    assert (t.name, t.path, t.max_new_tokens, t.temperature, t.stop, add.name) == (
        "t", data / "d.jsonl", 3, 0.0, ("\n",), "add")
    fleet = build_block("fleet", {"attach": ["http://127.0.0.1:1"], "router": "http://127.0.0.1:2",
                                  "admin_api_key_file": "admin"}, data, "gpu-a")
    assert isinstance(fleet, FleetBlock)
    assert (fleet.mode, fleet.name, fleet.engine_urls, fleet.router_url, fleet.api_key) == (
        "attach", "gpu-a", ["http://127.0.0.1:1"], "http://127.0.0.1:2", None)
    assert fleet.admin_api_key is not None and fleet.admin_api_key.get_secret_value() == "adm"
    shared = build_block("fleet", {"launch": True, "state_file": "f.json", "lock": "gpu-a"}, data, "gpu-a-lora")
    assert isinstance(shared, FleetBlock) and (shared.lock_name, shared.state_file) == ("fleet-gpu-a",
                                                                                        str(data / "f.json"))
    staging = build_block("staging", {"root": "st", "source_root": ["ckpt", "s3://b/c"], "keep": 1}, data, "x")
    assert isinstance(staging, StagingBlock)
    assert (staging.root, staging.source_roots, staging.keep_snapshots) == (
        str(data / "st"), [str(data / "ckpt"), "s3://b/c"], 1)
    sinks = build_block("sinks", {"jsonl": "m.jsonl"}, data, "x")
    assert isinstance(sinks, SinksBlock) and sinks.jsonl_path == str(data / "m.jsonl")
    samples = build_block("sinks", {"results_root": "r", "wandb_samples_per_dataset": "7",
                                    "mlflow_samples_per_dataset": 1000}, data, "x")
    assert isinstance(samples, SinksBlock)
    assert (samples.wandb_samples_per_dataset, samples.mlflow_samples_per_dataset) == (7, 1000)


def test_init_writes_a_config_that_builds_every_block_and_never_overwrites(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    code, out = cli("init", str(proj))
    assert code == 0, out
    assert sorted(str(p.relative_to(proj)) for p in proj.rglob("*") if p.is_file()) == [
        "data/sample.jsonl", "eval.yaml", "pinned-eval.yaml"]
    sections = load_project_config(proj / "pinned-eval.yaml")
    assert sorted(sections) == ["fleet", "sinks", "staging", "suite"]
    built = {kind: build_block(kind, fields, proj, "default") for kind, fields in sections.items()}
    suite = built["suite"]
    assert isinstance(suite, EvalSuiteBlock)
    [ds] = suite.resolved()
    assert (ds.name, ds.path, ds.reward, ds.max_new_tokens, ds.temperature) == (
        "sample", proj / "data" / "sample.jsonl", "exact_match", 8, 0.0)
    assert isinstance(built["staging"], StagingBlock) and built["staging"].root == str(proj / ".pinned-eval/staging")
    assert isinstance(built["fleet"], FleetBlock) and built["fleet"].mode == "launch"
    assert isinstance(built["sinks"], SinksBlock) and built["sinks"].wandb_samples_per_dataset == 0
    text = (proj / "pinned-eval.yaml").read_text()  # the commented sample-table keys, switched on as shown
    for key in ("results_root", "wandb_project", "wandb_samples_per_dataset", "mlflow_samples_per_dataset"):
        text = text.replace(f"  # {key}: ", f"  {key}: ", 1)
    (proj / "on.yaml").write_text(text)
    sinks = build_block("sinks", load_project_config(proj / "on.yaml")["sinks"], proj, "default")
    assert isinstance(sinks, SinksBlock)
    assert (sinks.results_root, sinks.wandb_project, sinks.wandb_samples_per_dataset,
            sinks.mlflow_samples_per_dataset) == (str(proj / ".pinned-eval/results"), "my-project", 8, 8)
    (proj / "on.yaml").unlink()
    before = (proj / "eval.yaml").read_text()
    (proj / "eval.yaml").write_text(before + "# mine\n")
    code, out = cli("init", str(proj))
    assert code == 1 and out.strip() == (f"error: {proj / 'pinned-eval.yaml'}, {proj / 'eval.yaml'}, "
                                         f"{proj / 'data' / 'sample.jsonl'} exists; nothing written (init never "
                                         "overwrites)")
    assert (proj / "eval.yaml").read_text() == before + "# mine\n"


@pytest.mark.parametrize(("text", "message"), [
    ("staging:\n  root: st\n  keep: [1\n", "{f}: not valid YAML (line 4, column 1): expected ',' or ']', but got "
                                          "'<stream end>'"),
    ("fleets:\n  launch: true\n", "{f}: fleets: not a section (sections: suite, fleet, staging, sinks)"),
    ("staging:\n  root: st\n  keeps: 1\n", "{f}: staging.keeps: not a known key"),
    ("staging:\n  root: st\n  keep: -1\n", "{f}: staging.keep: Input should be greater than or equal to 0 (got -1)"),
    ("suite:\n  from_yaml: e.yaml\n", "{f}: suite.from_yaml: {d}/e.yaml: no such file"),
    ("sinks:\n  results_root: r\n  wandb_samples_per_dataset: -2\n",
     "{f}: sinks.wandb_samples_per_dataset: Input should be greater than or equal to 0 (got -2)"),
    ("sinks:\n  results_root: r\n  wandb_samples_per_dataset: 5000\n",
     "{f}: sinks.wandb_samples_per_dataset: Input should be less than or equal to 1000 (got 5000)"),
    ("sinks:\n  results_root: r\n  wandb_samples_per_dataset: lots\n",
     "{f}: sinks.wandb_samples_per_dataset: not a whole number from 0 to 1000 (got 'lots')"),
    ("sinks:\n  results_root: r\n  wandb_samples_per_dataset: true\n",
     "{f}: sinks.wandb_samples_per_dataset: not a whole number from 0 to 1000 (got True)"),
    ("sinks:\n  wandb_samples_per_dataset: 2\n",
     "{f}: sinks.wandb_samples_per_dataset: needs a results root (results_root or results_s3_bucket_block): the "
     "W&B table is read from the point's kept samples"),
    ("- 1\n", "{f}: expected sections suite, fleet, staging, sinks (a mapping), got list"),
])
def test_apply_refusals_name_the_file_and_key(data: Path, text: str, message: str) -> None:
    config = data / "pinned-eval.yaml"
    config.write_text(text)
    code, out = cli("block", "apply", str(config))
    assert (code, out.strip()) == (2, "error: " + message.format(f=config, d=data)), out


def test_a_miles_yaml_syntax_error_names_the_file_and_line(data: Path) -> None:
    bad = data / "eval.yaml"
    bad.write_text("eval:\n  datasets:\n  - name: a\n   path: x\n")
    code, out = cli("block", "save", "suite", "default", "--from-yaml", str(bad))
    assert (code, out.strip()) == (2, f"error: --from-yaml: eval config {bad}: not valid YAML (line 4, column 4): "
                                      "expected <block end>, but found '<block mapping start>'")
    assert "<unicode string>" not in out
    bad.write_text("eval:\n  datasets:\n    - name: a\n      path: d.jsonl\n")  # no rm_type: a key error
    code, out = cli("block", "save", "suite", "default", "--from-yaml", str(bad))
    assert (code, out.strip()) == (2, f"error: --from-yaml: {bad}: eval.datasets[0].rm_type: required (no rm_type "
                                      "here, none under eval.defaults and no --rm-type: miles has no reward for it)")
    assert os.path.isabs(str(bad))
