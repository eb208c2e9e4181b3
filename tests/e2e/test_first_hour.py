"""A new user's first hour, through the real CLI (`python -m app.cli` subprocesses, a fresh
`PINNED_EVAL_HOME`): `init` → own JSONL dataset + miles-style YAML → blocks saved by
`block apply` (samples kept: `results_root`) and `suite miles --save` → `tiny-model` (marked
complete) → a source outside the staging roots refused before sending → a point requested with a
relative `--source` and measured on the session's CPU fleet (attached by URL with key files) by the
deployed worker → `status` → `compare` → `rescore` (the walk's last step, a point measured through
`pinned-eval worker` and then stopped as a user would, is `tests/e2e/test_worker_stop.py`). Plus the block verbs against
the real server: save, overwrite refusal, show (secrets masked), list, and the missing-block note.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import app
from app.commands.blocks import missing_blocks
from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
from pinned_eval.events import BlockNames
from pinned_eval.sinks import JsonlSink
from tests.deploykit import Deployed
from tests.pointkit import CpuFleet

pytestmark = pytest.mark.e2e

OWN_ROWS = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in (1, 2, 3) for b in (1, 2)]


def pe(*args: str, env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def key_file(path: Path, key: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, key.encode() + b"\n")
    os.close(fd)
    return path


@pytest.mark.timeout(900)  # a Prefect server, the CPU fleet and the worker start first; 8 CLI processes
def test_own_dataset_and_yaml_to_a_measured_point_through_the_cli(
    deployed: Deployed, cpu_fleet: CpuFleet, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    name, run, proj = f"fh-{tag}", f"fh{tag}", tmp_path / "proj"
    env = dict(os.environ, PINNED_EVAL_HOME=str(tmp_path / "home"), PREFECT_API_URL=deployed.api_url)

    done = pe("init", str(proj), env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # the user's own dataset (own keys) and eval YAML, miles-style
    (proj / "data" / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in OWN_ROWS))
    (proj / "eval.yaml").write_text(
        "eval:\n  defaults:\n    rm_type: exact_match\n    max_response_len: 3\n    temperature: 0.0\n"
        "  datasets:\n    - name: Mine.v1\n      path: data/mine.jsonl\n      input_key: question\n"
        "      label_key: answer\n"
    )
    key_file(proj / "engine-api-key", cpu_fleet.api_key)
    key_file(proj / "engine-admin-key", cpu_fleet.admin_api_key)
    attach = "".join(f"\n    - {u}" for u in cpu_fleet.engine_urls)
    (proj / "pinned-eval.yaml").write_text(
        "suite:\n  from_yaml: eval.yaml\n"
        f"fleet:\n  attach:{attach}\n  router: {cpu_fleet.router_url}\n  api_key_file: engine-api-key\n"
        "  admin_api_key_file: engine-admin-key\n"
        "staging:\n  root: staging\n  source_root: [ckpt]\n  keep: 1\n"
        "sinks:\n  jsonl: metrics.jsonl\n  results_root: results\n"
    )
    done = pe("block", "apply", "pinned-eval.yaml", "--name", name, env=env, cwd=proj)
    assert (done.returncode, done.stdout) == (0, "".join(f"saved {k} block {name!r}\n"
                                                         for k in ("suite", "fleet", "staging", "sinks"))), done.stderr
    # the miles YAML saved as its own suite block, on the home's server (never a throwaway one)
    done = pe("suite", "miles", "eval.yaml", "--save", f"{name}-miles", env=env, cwd=proj)
    assert (done.returncode, done.stderr.splitlines()[-1]) == (0, f"saved suite block '{name}-miles'"), done.stderr
    assert [ds.name for ds in EvalSuiteBlock.load(f"{name}-miles").resolved()] == ["Mine.v1"]
    done = pe("tiny-model", "--out", "ckpt/tiny", env=env, cwd=proj)
    assert (done.returncode, done.stdout) == (0, f"{proj / 'ckpt' / 'tiny'}\n"), done.stderr
    # a source outside the staging block's roots: refused before anything is sent, in words
    (proj / "elsewhere").mkdir()
    done = pe("request", "--run", run, "--step", "0", "--source", "hf:elsewhere", f"--staging={name}",
              f"--suite={name}-miles", f"--fleet={name}", f"--sinks={name}", env=env, cwd=proj)
    assert done.returncode == 2 and done.stderr.startswith(f"error: --source: {proj / 'elsewhere'} is outside the "
                                                           f"source roots of staging block {name!r}"), done.stderr
    assert "nothing was sent" in done.stderr and "SourceOutsideRoots" not in done.stderr
    # the same point sent by an older client: it fails before the flow tags it; `rerun` and a plain
    # `request` of that step find it and name the command that works (no wait on a useless hint)
    from prefect import get_client

    from pinned_eval.polling import poll_until

    with get_client(sync_client=True) as client:
        early = client.create_flow_run_from_deployment(deployed.deployment_id, parameters={
            "run": run, "step": 7, "source": {"kind": "hf", "path": str(proj / "elsewhere")}, "suite": f"{name}-miles",
            **{k: name for k in ("fleet", "staging", "sinks")}})
        poll_until(lambda: ((fr := client.read_flow_run(early.id)).state and fr.state.is_final()) or None,
                   timeout_s=240, interval_s=0.5, what="the early failure")
    done = pe("rerun", "--run", run, "--step", "7", env=env, cwd=proj)
    assert done.returncode == 1 and done.stderr.startswith(f"error: {run}/step-7 ({early.id}) ended before it "
                                                           "started"), done.stderr
    assert done.stderr.rstrip().endswith(f"request it again: `pinned-eval request --run {run} --step 7 --source "
                                         f"hf:{proj / 'elsewhere'} --force-new`"), done.stderr
    done = pe("request", "--run", run, "--step", "7", "--source", "hf:ckpt/tiny", f"--suite={name}-miles",
              *(f"--{k}={name}" for k in ("fleet", "staging", "sinks")), env=env, cwd=proj)
    assert done.returncode == 2 and f"was requested before ({early.id}) and ended before it started" in done.stderr
    assert "`--force-new` requests a fresh point of the step" in done.stderr, done.stderr

    # a relative source: made absolute here, where the user typed it (the worker runs elsewhere)
    done = pe("request", "--run", run, "--step", "0", "--source", "hf:ckpt/tiny", f"--suite={name}-miles",
              *(f"--{k}={name}" for k in ("fleet", "staging", "sinks")), "--wait", "--timeout", "240",
              env=env, cwd=proj, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ": Completed (completed)" in done.stdout.splitlines()[-1], done.stdout
    done = pe("status", "--run", run, "--json", env=env, cwd=proj)
    point, early_point = sorted(json.loads(done.stdout)["points"], key=lambda p: p["step"])
    assert (point["outcome"], point["reason"], sorted(point["scores"])) == ("measured", None, ["Mine.v1"])
    # the early failure is on record at its step (the JSONL row), with no flow run status could tag
    assert [early_point[k] for k in ("step", "outcome", "reason", "flow_run_id")] == [7, "failed", "crashed", None]
    [row] = [r for r in JsonlSink(proj / "metrics.jsonl").read(run) if r.step == 0]
    assert (row.step, row.state, row.dataset, row.weight_version) == (0, "measured", "Mine.v1", "0")
    assert row.metrics["eval/Mine.v1-none_reward_ratio"] == 0.0  # every row of the user's file was scored
    measured = row.metrics["eval/Mine.v1"]
    # the kept samples: compare (nothing flips against itself) and rescore (same rewards, same score)
    done = pe("compare", run, "0", "0", f"--sinks={name}", "--json", env=env, cwd=proj)
    flips = [{"dataset": "Mine.v1", "examples": 6, "lost": [], "gained": [], "unmatched": 0}]
    assert (done.returncode, json.loads(done.stdout), done.stderr) == (0, flips, ""), done.stderr
    done = pe("rescore", run, "0", f"--suite={name}-miles", f"--sinks={name}", env=env, cwd=proj)
    assert (done.returncode, done.stdout) == (0, f"Mine.v1: eval/Mine.v1={measured:.4f} (rescored)\n"), done.stderr
    [row] = [r for r in JsonlSink(proj / "metrics.jsonl").read(run) if r.step == 0]
    assert (row.metrics["eval/rescored"], row.metrics["eval/Mine.v1"]) == (1.0, measured)


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def test_block_verbs_save_show_list_and_name_missing_blocks(
    prefect_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    name = f"b-{uuid.uuid4().hex[:6]}"
    names = BlockNames(suite=name, fleet=name, staging=name, sinks=name)
    assert missing_blocks(names) == [
        f"missing suite block {name!r}: create it with `pinned-eval block save suite {name} --dataset "
        "NAME=FILE.jsonl (or --from-yaml eval.yaml)`",
        f"missing fleet block {name!r}: create it with `pinned-eval block save fleet {name} --launch (after "
        "`pinned-eval fleet up`) or --attach URL --router URL`",
        f"missing staging block {name!r}: create it with `pinned-eval block save staging {name} --root DIR "
        "--source-root CHECKPOINTS_DIR`",
        f"missing sinks block {name!r}: create it with `pinned-eval block save sinks {name} --jsonl FILE`",
    ]
    key = key_file(tmp_path / "admin", "adm1n-k3y")
    assert cli("block", "save", "suite", name, "--dataset", "t=d.jsonl", "--max-new-tokens", "3") == (
        0, f"saved suite block {name!r}\n")
    assert cli("block", "save", "fleet", name, "--launch", "--state-file", "fleet.json",
               "--admin-api-key-file", str(key)) == (0, f"saved fleet block {name!r}\n")
    assert cli("block", "save", "staging", name, "--root", "st", "--source-root", "ck") == (
        0, f"saved staging block {name!r}\n")
    assert cli("block", "save", "sinks", name, "--jsonl", "m.jsonl") == (0, f"saved sinks block {name!r}\n")
    assert missing_blocks(names) == []

    code, out = cli("block", "save", "staging", name, "--root", "other")
    assert (code, out.strip()) == (1, f"error: a staging block named {name!r} exists: pass --overwrite to replace "
                                      f"it (`pinned-eval block show staging {name}` shows it)")
    assert StagingBlock.load(name).root == str(tmp_path / "st")
    assert cli("block", "save", "staging", name, "--root", "other", "--overwrite")[0] == 0
    assert StagingBlock.load(name).root == str(tmp_path / "other")

    code, out = cli("block", "show", "fleet", name)
    assert code == 0 and "adm1n-k3y" not in out, out
    shown = json.loads(out)
    assert (shown["mode"], shown["name"], shown["state_file"], shown["admin_api_key"], shown["api_key"]) == (
        "launch", name, str(tmp_path / "fleet.json"), "********", None)
    assert FleetBlock.load(name).admin_api_key.get_secret_value() == "adm1n-k3y"  # type: ignore[union-attr]
    [ds] = EvalSuiteBlock.load(name).resolved()
    assert (ds.name, ds.path, ds.max_new_tokens) == ("t", tmp_path / "d.jsonl", 3)
    assert SinksBlock.load(name).jsonl_path == str(tmp_path / "m.jsonl")

    code, out = cli("block", "list")
    assert code == 0 and {f"{k:<8} {name}" for k in ("suite", "fleet", "staging", "sinks")} <= set(out.splitlines())
    code, out = cli("block", "show", "sinks", "nope-nope")
    assert (code, out.strip()) == (1, "error: no sinks block named 'nope-nope': create it with `pinned-eval block "
                                      "save sinks nope-nope --jsonl FILE`")
    code, out = cli("block", "show", "stagin", name)
    assert (code, out.strip()) == (2, "error: KIND: 'stagin' is not one of suite, fleet, staging, sinks, backend")


def test_results_root_is_a_flag_and_a_key_and_a_later_apply_names_what_it_resets(
    prefect_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    name = f"r-{uuid.uuid4().hex[:6]}"
    assert cli("block", "save", "sinks", name, "--jsonl", "m.jsonl", "--results-root", "res") == (
        0, f"saved sinks block {name!r}\n")
    assert SinksBlock.load(name).results_root == str(tmp_path / "res")
    (tmp_path / "p.yaml").write_text("sinks:\n  jsonl: m.jsonl\n  results_root: kept\n")
    assert cli("block", "apply", "p.yaml", "--name", name) == (0, f"replaced sinks block {name!r}\n")
    assert SinksBlock.load(name).results_root == str(tmp_path / "kept")
    (tmp_path / "p.yaml").write_text("sinks:\n  jsonl: m.jsonl\n")  # the key removed: said, not silent
    assert cli("block", "apply", "p.yaml", "--name", name) == (
        0, f"replaced sinks block {name!r}; reset to default: results_root (was \"{tmp_path / 'kept'}\")\n")
    assert SinksBlock.load(name).results_root is None


def test_sample_table_counts_are_flags_and_keys_read_back_from_the_server(
    prefect_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    name = f"w-{uuid.uuid4().hex[:6]}"

    def saved() -> tuple[int, int]:
        block = SinksBlock.load(name)
        return block.wandb_samples_per_dataset, block.mlflow_samples_per_dataset  # type: ignore[attr-defined]

    assert cli("block", "save", "sinks", name, "--results-root", "res", "--wandb-samples-per-dataset", "7",
               "--mlflow-samples-per-dataset", "9") == (0, f"saved sinks block {name!r}\n")
    assert saved() == (7, 9)
    code, out = cli("block", "save", "sinks", name, "--results-root", "res", "--wandb-samples-per-dataset", "x7",
                    "--overwrite")
    assert (code, out) == (2, "error: --wandb-samples-per-dataset: not a whole number from 0 to 1000 (got 'x7')\n")
    assert saved() == (7, 9), "a refused save changes nothing"
    (tmp_path / "p.yaml").write_text("sinks:\n  results_root: res\n  wandb_samples_per_dataset: 1000\n"
                                     "  mlflow_samples_per_dataset: 9\n")
    assert cli("block", "apply", "p.yaml", "--name", name) == (0, f"replaced sinks block {name!r}\n")
    assert saved() == (1000, 9)
    (tmp_path / "p.yaml").write_text("sinks:\n  results_root: res\n  mlflow_samples_per_dataset: 9\n")
    assert cli("block", "apply", "p.yaml", "--name", name) == (
        0, f"replaced sinks block {name!r}; reset to default: wandb_samples_per_dataset (was 1000)\n")
    assert saved() == (0, 9)
