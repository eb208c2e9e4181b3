"""The external posture's contract without servers: inputs, results → metrics, skips, loading,
the SGLang launch command, the evaluate_external task's skip/dispose mapping, the miles adapter's config."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

from pinned_eval.external import (
    CheckpointEvalFn,
    DatasetResult,
    EvalInput,
    EvalResults,
    EvalSkip,
    load_backend,
    results_from_rows,
    results_to_metrics,
    run_backend,
    sample_rows,
    samples_artifact_key,
)
from pinned_eval.skips import EvalSkipped, skip_metric
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults
from tasks.external import BACKENDS, BackendCache, backend_lock_name, evaluate_external
from trainer_integration.miles_adapter import AdapterConfig, MilesEvalSkip, PinnedEvalFn
from trainer_integration.sglang_backend import SGLangBackendConfig, launch_spec, sglang_launch_spec

SUITE = EvalSuite(
    datasets=(
        DatasetSpec(name="greedy", path="builtin:arith_add.jsonl"),
        DatasetSpec(name="sampled", path="builtin:arith_add.jsonl", n_samples_per_prompt=2),
    ),
    defaults=SamplingDefaults(temperature=0.0, max_new_tokens=3),
    pass_at_k=True,
)


def _input(step: int = 5) -> EvalInput:
    return EvalInput(run="exp42", step=step, hf_dir="/snap/step_5", suite=SUITE)


def _results(version: str = "5") -> EvalResults:
    return EvalResults(
        data={
            "greedy": DatasetResult(
                rewards=[1.0, None], truncated=[False, True], weight_versions=[version] * 2, response_lens=[2, 4]
            ),
            "sampled": DatasetResult(
                rewards=[1.0, 0.0, 0.0, 0.0],
                truncated=[False] * 4,
                weight_versions=[version] * 4,
                response_lens=[1, 1, 3, 3],
            ),
        },
        metrics={"eval/backend_seconds": 2.5},
    )


def test_input_carries_weight_version_and_resolved_datasets() -> None:
    inp = _input(7)
    assert inp.weight_version == "7"
    assert inp.model_dump()["weight_version"] == "7"
    assert [d.name for d in inp.datasets] == ["greedy", "sampled"]
    with pytest.raises(ValueError, match="run"):
        EvalInput(run="Bad Run", step=1, hf_dir="/x", suite=SUITE)


def test_results_to_metrics_follows_design_metrics() -> None:
    out = results_to_metrics(_results(), _input())
    g, s = out["greedy"], out["sampled"]
    assert g["eval/greedy"] == 0.5 and g["eval/greedy-none_reward_ratio"] == 0.5
    assert g["eval/greedy-truncated_ratio"] == 0.5
    assert g["eval/greedy/response_len/mean"] == 3.0
    assert g["eval/greedy/weight_version/mean"] == 5 and g["eval/greedy/weight_version/mixed_version_ratio"] == 0
    assert "eval/greedy-pass@2" not in g  # n = 1
    # prompt-major: prompt 0 = [1, 0] (one correct of 2), prompt 1 = [0, 0]
    assert s["eval/sampled-pass@1"] == pytest.approx(0.25)
    assert s["eval/sampled-pass@2"] == pytest.approx(0.5)
    assert g["eval/backend_seconds"] == s["eval/backend_seconds"] == 2.5


def test_samples_from_other_weights_show_as_mixed() -> None:
    out = results_to_metrics(_results(version="4"), _input())
    assert out["greedy"]["eval/greedy/weight_version/mixed_version_ratio"] == 1.0
    assert out["greedy"]["eval/greedy/weight_version/mean"] == 4


def test_results_that_do_not_fit_the_suite_are_refused() -> None:
    good = _results()
    only_greedy = EvalResults(data={"greedy": good.data["greedy"]})
    with pytest.raises(ValueError, match=r"missing datasets \['sampled'\]"):
        results_to_metrics(only_greedy, _input())
    extra = EvalResults(data={**good.data, "other": good.data["greedy"]})
    with pytest.raises(ValueError, match=r"unexpected datasets \['other'\]"):
        results_to_metrics(extra, _input())
    with pytest.raises(ValueError, match="must start with 'eval/'"):
        results_to_metrics(EvalResults(data=good.data, metrics={"loss": 1.0}), _input())
    with pytest.raises(ValueError, match="computed by pinned-eval"):
        results_to_metrics(EvalResults(data=good.data, metrics={"eval/greedy": 1.0}), _input())


def test_sample_count_must_be_a_multiple_of_n_and_lists_aligned() -> None:
    odd = DatasetResult(rewards=[1.0] * 3, truncated=[False] * 3, weight_versions=["5"] * 3, response_lens=[1] * 3)
    with pytest.raises(ValueError, match="not a multiple of n=2"):
        results_to_metrics(EvalResults(data={**_results().data, "sampled": odd}), _input())
    with pytest.raises(ValueError, match="differ in length"):
        DatasetResult(rewards=[1.0], truncated=[], weight_versions=["5"], response_lens=[1])


def test_eval_skip_is_an_eval_skipped_with_a_slug_and_survives_pickling() -> None:
    skip = EvalSkip("quota", "monthly budget spent")
    assert isinstance(skip, EvalSkipped) and skip.reason == "quota"
    assert skip_metric(skip.reason) == "eval/skipped_quota"
    again = pickle.loads(pickle.dumps(skip))
    assert (type(again), again.reason, again.message) == (EvalSkip, "quota", "monthly budget spent")
    with pytest.raises(ValueError, match="slug"):
        EvalSkip("Out Of Quota")


def test_sample_rows_round_trip() -> None:
    data = _results().data
    rows = sample_rows(data)
    assert len(rows) == 6 and rows[1] == {
        "dataset": "greedy", "index": 1, "reward": None, "truncated": True, "weight_version": "5", "response_len": 4,
    }
    assert results_from_rows(list(reversed(rows))) == data
    with pytest.raises(ValueError, match="indices"):
        results_from_rows(rows[1:])
    assert samples_artifact_key("exp_42", 7) == "eval-exp-u42-step-7-samples"  # `history_artifact_key`: "_" is "-u"


# ---------------------------------------------------------------------------- backends


class RecordingBackend(CheckpointEvalFn):
    """Test backend: records its calls; `mode` picks what it does."""

    calls: ClassVar[list[tuple]] = []

    def __init__(self, mode: str = "measure") -> None:
        self.mode = mode
        RecordingBackend.calls.append(("init", mode))

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:
        RecordingBackend.calls.append(("eval", checkpoint_dir, input.weight_version))
        if self.mode == "quota":
            raise EvalSkip("quota", "no credits left")
        if self.mode == "boom":
            raise RuntimeError("backend exploded")
        return _results(input.weight_version)

    def dispose(self) -> None:
        RecordingBackend.calls.append(("dispose",))


class SyncBackend(CheckpointEvalFn):
    def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:  # type: ignore[override]
        return _results(input.weight_version)


def test_load_backend_by_either_dotted_form() -> None:
    assert load_backend(f"{__name__}:RecordingBackend") is RecordingBackend
    assert load_backend(f"{__name__}.RecordingBackend") is RecordingBackend
    with pytest.raises(TypeError, match="not a CheckpointEvalFn"):
        load_backend(f"{__name__}:test_sample_rows_round_trip")
    with pytest.raises(ValueError, match="no attribute"):
        load_backend(f"{__name__}:Nope")
    with pytest.raises(ValueError, match="module:Class"):
        load_backend("not a path")


async def test_run_backend_accepts_async_and_sync() -> None:
    assert (await run_backend(SyncBackend(), "/snap", _input())).data["greedy"].rewards == [1.0, None]
    assert (await run_backend(RecordingBackend(), "/snap", _input())).metrics == {"eval/backend_seconds": 2.5}


@pytest.fixture
def backends() -> Iterator[BackendCache]:
    BACKENDS.dispose_all()  # the cache is per process: earlier tests' backends are not this test's
    RecordingBackend.calls = []
    yield BACKENDS
    BACKENDS.dispose_all()


@pytest.mark.parametrize(("mode", "error", "reason"), [("quota", EvalSkipped, "quota"), ("boom", RuntimeError, None)])
def test_task_maps_skips_and_drops_crashed_backends(
    backends: BackendCache, mode: str, error: type[Exception], reason: str | None
) -> None:
    with pytest.raises(error) as info:
        evaluate_external.fn(f"{__name__}:RecordingBackend", "/snap/step_5", "exp42", 5, SUITE, {"mode": mode})
    assert type(info.value) is error  # quota → a plain EvalSkipped (the flow's skip path), boom → a crash
    if reason:
        assert info.value.reason == reason and "no credits" in info.value.message
        # an attributable skip keeps the instance for the next point; it is disposed at exit
        assert RecordingBackend.calls == [("init", mode), ("eval", "/snap/step_5", "5")] and len(backends) == 1
        backends.dispose_all()
    assert RecordingBackend.calls == [("init", mode), ("eval", "/snap/step_5", "5"), ("dispose",)]
    assert len(backends) == 0


def test_task_reuses_one_backend_per_configuration(backends: BackendCache) -> None:
    path = f"{__name__}:RecordingBackend"
    out = evaluate_external.fn(path, "/snap", "exp42", 9, SUITE, record_samples=False)
    assert set(out) == {"greedy", "sampled"} and out["greedy"]["eval/greedy/weight_version/mean"] == 9
    evaluate_external.fn(path, "/snap", "exp42", 10, SUITE, record_samples=False)
    evaluate_external.fn(path, "/snap", "exp42", 11, SUITE, {"mode": "measure"}, record_samples=False)
    assert RecordingBackend.calls == [
        ("init", "measure"), ("eval", "/snap", "9"), ("eval", "/snap", "10"),
        ("init", "measure"), ("eval", "/snap", "11"),  # other options, another configuration
    ]
    assert backend_lock_name(path, None) == backend_lock_name(path, {})
    assert backend_lock_name(path, None).startswith("backend-recordingbackend-")
    assert backend_lock_name(path, None) != backend_lock_name(path, {"mode": "measure"})
    with pytest.raises(ValueError, match="backend_options"):
        backend_lock_name(path, {"mode": object()})


class FileBackend(CheckpointEvalFn):
    """Writes its lifecycle to `log` (a file), for a check across a process exit."""

    def __init__(self, log: str) -> None:
        self.log = log
        self._write("init")

    def _write(self, line: str) -> None:
        with open(self.log, "a") as f:
            f.write(line + "\n")

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:
        self._write(f"eval {input.weight_version}")
        return _results(input.weight_version)

    def dispose(self) -> None:
        self._write("dispose")


def test_cached_backends_are_disposed_at_interpreter_exit(tmp_path: Path) -> None:
    log = tmp_path / "lifecycle"
    code = (
        "from tasks.external import BACKENDS, BackendCache, backend_lock_name, evaluate_external\n"
        f"from {__name__} import SUITE\n"
        "for step in (1, 2):\n"
        f"    evaluate_external.fn('{__name__}:FileBackend', '/snap', 'exp42', step, SUITE, {{'log': {str(log)!r}}},"
        " record_samples=False)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == ["init", "eval 1", "eval 2", "dispose"]


# ---------------------------------------------------------------------------- SGLang reference backend


def test_sglang_launch_builds_real_command_on_named_gpus() -> None:
    cfg = SGLangBackendConfig(
        launch="sglang", model_path="/base", gpus="6,7", server_args={"mem_fraction_static": 0.8},
        extra_args=["--trust-remote-code", "--foo", "1"], python="/py",
    )
    spec = sglang_launch_spec(cfg, 31000)
    cmd = spec.command
    assert cmd[:3] == ["/py", "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--model-path") + 1] == "/base"
    assert cmd[cmd.index("--tp-size") + 1] == "2"
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.8"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "31000"
    assert cmd[-3:] == ["--trust-remote-code", "--foo", "1"]  # raw extras last
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert spec.url == "http://127.0.0.1:31000"


def test_cpu_launch_builds_the_bundled_engine_command_and_runs_it() -> None:
    cfg = SGLangBackendConfig(launch="cpu", model_path="/base", port=4321, extra_args=["--max-batch-size", "8"])
    spec = launch_spec(cfg)
    assert spec.command[1:3] == ["-m", "engine"]
    assert spec.command[spec.command.index("--port") + 1] == "4321" and spec.port == 4321
    assert spec.command[-2:] == ["--max-batch-size", "8"]
    # the argv is one the engine CLI accepts
    help_run = subprocess.run([sys.executable, *spec.command[1:3], "--help"], capture_output=True, text=True)
    assert help_run.returncode == 0 and "--model-path" in help_run.stdout


def test_backend_config_modes_and_env() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        SGLangBackendConfig()
    with pytest.raises(ValueError, match="model_path"):
        SGLangBackendConfig(launch="cpu")
    with pytest.raises(ValueError, match="gpus"):
        SGLangBackendConfig(launch="sglang", model_path="/m")
    attach = SGLangBackendConfig.from_env({"PINNED_EVAL_EXTERNAL_URL": "http://eval-host:31000"})
    assert attach.url == "http://eval-host:31000" and attach.launch is None
    launch = SGLangBackendConfig.from_env(
        {"PINNED_EVAL_EXTERNAL_GPUS": "6,7", "PINNED_EVAL_EXTERNAL_MODEL_PATH": "/base",
         "PINNED_EVAL_EXTERNAL_SERVER_ARGS": "--trust-remote-code --x 'a b'"}
    )
    assert (launch.launch, launch.gpus, launch.extra_args) == ("sglang", [6, 7], ["--trust-remote-code", "--x", "a b"])


# ---------------------------------------------------------------------------- miles adapter


def test_adapter_config_from_env_then_args(monkeypatch: pytest.MonkeyPatch) -> None:
    # the environment passed is the whole environment: the process's own credential never leaks in
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "leak:from-the-process")
    env = {
        "PREFECT_API_URL": "http://127.0.0.1:4200/api",
        "PREFECT_API_KEY": "sekrit",
        "PINNED_EVAL_MILES_RUN": "exp42",
        "PINNED_EVAL_MILES_BLOCKS": '{"suite": "gsm8k"}',
        "PINNED_EVAL_MILES_POLICY": "skip",
    }
    args = SimpleNamespace(pinned_eval_run="exp43", pinned_eval_parameters={"backend": "x:Y"})
    cfg = AdapterConfig.from_args(args, env)
    assert (cfg.api_url, cfg.run, cfg.policy, cfg.blocks.suite, cfg.blocks.fleet) == (
        "http://127.0.0.1:4200/api", "exp43", "skip", "gsm8k", "default",
    )
    assert cfg.parameters == {"backend": "x:Y"}
    assert cfg.headers() == {"Authorization": "Bearer sekrit"} and "sekrit" not in repr(cfg)
    with pytest.raises(ValueError, match="run"):
        AdapterConfig.from_args(None, {"PREFECT_API_URL": "http://x/api"})


async def test_adapter_refuses_train_calls_and_missing_snapshots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.setenv("PINNED_EVAL_MILES_RUN", "exp42")
    fn = PinnedEvalFn(SimpleNamespace(args=SimpleNamespace(), data_source=None))
    with pytest.raises(ValueError, match="only serves eval"):
        await fn(SimpleNamespace(rollout_id=3, evaluation=False, hf_dir="/x"))
    with pytest.raises(ValueError, match="no snapshot"):
        await fn(SimpleNamespace(rollout_id=3, evaluation=True, hf_dir=None))
    assert issubclass(MilesEvalSkip, Exception)


def test_adapter_basic_auth_wins_over_bearer() -> None:
    cfg = AdapterConfig(api_url="http://x/api", run="exp42", api_key="k", auth_string="user:pass")
    assert cfg.headers() == {"Authorization": "Basic dXNlcjpwYXNz"}
