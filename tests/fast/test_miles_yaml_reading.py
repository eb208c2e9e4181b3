"""miles' eval YAML read as miles reads it: OmegaConf interpolations, strict miles keys, a required
rm_type, file errors that name the file (issue 17 item 3, issue 16 item 11)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from pinned_eval.miles_config import EXTENSION_KEYS, MilesDivergenceWarning
from pinned_eval.suite import EvalSuite

EXAMPLE = """\
# miles example style: data under a directory given by the environment
eval:
  defaults:
    max_response_len: 16384
    top_p: 0.7
  datasets:
    - name: aime
      path: ${DATA_DIR}/aime-2024/aime-2024.jsonl
      rm_type: deepscaler
      n_samples_per_eval_prompt: 16
    - name: gpqa
      path: ${oc.env:DATA_DIR}/gpqa/gpqa_eval.jsonl
      rm_type: gpqa
"""


@pytest.fixture
def example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("DATA_DIR", raising=False)
    path = tmp_path / "multi_task.yaml"
    path.write_text(EXAMPLE, encoding="utf-8")
    return path


def test_data_dir_from_the_environment(example: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATA_DIR", "/env/data")
    aime, gpqa = EvalSuite.from_miles_yaml(example).resolved()
    assert (str(aime.path), str(gpqa.path)) == ("/env/data/aime-2024/aime-2024.jsonl", "/env/data/gpqa/gpqa_eval.jsonl")


def test_caller_values_win_over_the_environment(example: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATA_DIR", "/env/data")
    aime, gpqa = EvalSuite.from_miles_yaml(example, variables={"DATA_DIR": "/set/data"}).resolved()
    assert (str(aime.path), str(gpqa.path)) == ("/set/data/aime-2024/aime-2024.jsonl", "/set/data/gpqa/gpqa_eval.jsonl")


def test_unresolved_interpolation_is_refused_naming_its_key(example: Path) -> None:
    with pytest.raises(ValueError, match=r"^eval\.datasets\[0\]\.path: cannot resolve .*DATA_DIR.*--set NAME=VALUE"):
        EvalSuite.from_miles_yaml(example)


def test_unresolved_env_interpolation_is_refused_naming_its_key(example: Path) -> None:
    text = example.read_text().replace("${DATA_DIR}/aime", "/fixed/aime")
    with pytest.raises(ValueError, match=r"^eval\.datasets\[1\]\.path: cannot resolve .*DATA_DIR"):
        EvalSuite.from_miles_yaml(text)


def test_a_dataset_without_rm_type_and_no_default_is_refused_naming_it() -> None:
    text = "eval:\n  datasets:\n    - {name: a, path: /a.jsonl, rm_type: math}\n    - {name: b, path: /b.jsonl}\n"
    with pytest.raises(ValueError, match=r"^eval\.datasets\[1\]\.rm_type: required"):
        EvalSuite.from_miles_yaml(text)
    # miles' --rm-type (or eval.defaults.rm_type) fills it
    assert [d.reward for d in EvalSuite.from_miles_yaml(text, rm_type="f1").resolved()] == ["math", "f1"]
    with_default = text.replace("eval:\n", "eval:\n  defaults: {rm_type: dapo}\n")
    assert [d.reward for d in EvalSuite.from_miles_yaml(with_default).resolved()] == ["math", "dapo"]


@pytest.mark.parametrize("key", EXTENSION_KEYS)
def test_strict_miles_refuses_each_pinned_eval_extension(key: str) -> None:
    value = {"apply_chat_template_kwargs": "{}", "system_prompt": "x", "reward": "math"}.get(key, "1")
    text = f"eval:\n  datasets:\n    - {{name: a, path: /a.jsonl, rm_type: math, {key}: {value}}}\n"
    with pytest.raises(ValueError, match=rf"^eval\.datasets\[0\]\.{key}: a pinned-eval extension"):
        EvalSuite.from_miles_yaml(text, strict_miles=True)


def test_strict_miles_refuses_exact_match_and_loads_a_miles_config(example: Path) -> None:
    text = "eval:\n  datasets:\n    - {name: a, path: /a.jsonl, rm_type: exact_match}\n"
    with pytest.raises(ValueError, match=r"^eval\.datasets\[0\]\.rm_type: reward 'exact_match': not a miles rm_type"):
        EvalSuite.from_miles_yaml(text, strict_miles=True)
    suite = EvalSuite.from_miles_yaml(example, strict_miles=True, variables={"DATA_DIR": "/d"})
    assert [d.reward for d in suite.resolved()] == ["deepscaler", "gpqa"]


def test_boxed_math_loads_with_a_divergence_warning() -> None:
    text = "eval:\n  datasets:\n    - {name: a, path: /a.jsonl, rm_type: boxed_math}\n"
    with pytest.warns(MilesDivergenceWarning, match=r"eval\.datasets\[0\]\.rm_type: miles' boxed_math scores 0"):
        [ds] = EvalSuite.from_miles_yaml(text).resolved()
    assert ds.reward == "boxed_math"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EvalSuite.from_miles_yaml(text.replace("boxed_math", "math"))


def test_non_utf8_file_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"eval:\n  datasets:\n    - {name: caf\xe9, path: /a.jsonl, rm_type: math}\n")
    with pytest.raises(ValueError, match=rf"^eval config {path}: not UTF-8 \(line 3,"):
        EvalSuite.from_miles_yaml(path)


def test_yaml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("eval:\n  datasets: [unclosed\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^eval config {path}: not valid YAML \(line 3,") as info:
        EvalSuite.from_miles_yaml(path)
    assert "<unicode string>" not in str(info.value)


def test_cli_set_resolves_and_a_missing_value_exits_2_naming_the_key(example: Path) -> None:
    from typer.testing import CliRunner

    from app.cli import app

    ok = CliRunner().invoke(app, ["suite", "miles", str(example), "--set", "DATA_DIR=/cli", "--strict-miles"])
    assert ok.exit_code == 0, ok.output
    assert '"path": "/cli/aime-2024/aime-2024.jsonl"' in ok.stdout
    refused = CliRunner().invoke(app, ["suite", "miles", str(example)])
    assert refused.exit_code == 2
    assert "eval.datasets[0].path: cannot resolve" in refused.stderr
    bad = CliRunner().invoke(app, ["suite", "miles", str(example), "--set", "DATA_DIR"])
    assert bad.exit_code == 2 and "--set" in bad.output


MILES_RM = '''\
"""A miles --custom-rm-path module: async (args, sample)."""


async def judge(args, sample):
    ok = sample.response.strip() == str(sample.label) and sample.status == "completed"
    return {"score": 1.0 if ok else 0.0, "seen": (args.rm_type, args.custom_rm_path, sample.prompt,
            sample.metadata.get("split"), args.n_samples_per_eval_prompt, args.eval_temperature)}


SEEN = []


async def record(args, sample):
    SEEN.append((args.custom_rm_path, args.eval_max_response_len, sample.prompt, sample.label, dict(sample.metadata)))
    return 0.5
'''


def test_custom_rm_path_calls_an_async_args_sample_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from pinned_eval.scoring.remote import RewardItem, score_responses

    (tmp_path / "my_miles_rm.py").write_text(MILES_RM, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    text = ("eval:\n  defaults: {max_response_len: 32, rm_type: math}\n  datasets:\n"
            "    - {name: a, path: /a.jsonl, rm_type: gpqa, n_samples_per_eval_prompt: 2, temperature: 0.5}\n")
    suite = EvalSuite.from_miles_yaml(text, custom_rm_path="my_miles_rm.record")
    [ds] = suite.resolved()
    assert ds.reward == "custom:my_miles_rm.record"  # miles: --custom-rm-path overrides rm_type
    items = [RewardItem("What is 2+2?", "4", "4", {"split": "test"}), RewardItem("1+1?", "3", "2", {})]
    assert asyncio.run(score_responses(ds.reward, items, None, suite.miles_args(ds))) == [0.5, 0.5]
    import my_miles_rm  # type: ignore[import-not-found]

    assert my_miles_rm.SEEN == [
        ("my_miles_rm.record", 32, "What is 2+2?", "4", {"split": "test"}),
        ("my_miles_rm.record", 32, "1+1?", "2", {}),
    ]
    judge = EvalSuite.from_miles_yaml(text, custom_rm_path="my_miles_rm.judge")
    [jd] = judge.resolved()
    scored = asyncio.run(score_responses(jd.reward, items, None, judge.miles_args(jd)))
    assert scored == [1.0, 0.0]  # a dict reward: its "score"
