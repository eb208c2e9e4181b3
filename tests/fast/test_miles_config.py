"""miles' eval configs as they are: fixtures in the shape of miles' examples load; the rest is refused by key path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blocks import EvalSuiteBlock
from pinned_eval.miles_config import MILES_KEYS, UNSUPPORTED_UNLESS_EMPTY
from pinned_eval.suite import EvalSuite, RemoteRewardConfig, SamplingFallbacks, load_dataset

CONFIGS = Path(__file__).parents[1] / "miles_configs"
JUDGE = RemoteRewardConfig(url="http://127.0.0.1:9/score")


def test_miles_multi_task_example_loads() -> None:
    suite = EvalSuite.from_miles_yaml(CONFIGS / "multi_task.yaml")
    aime, gpqa = suite.resolved()
    assert (aime.name, aime.reward, aime.n_samples_per_prompt, aime.max_new_tokens, aime.top_p) == (
        "aime", "deepscaler", 16, 16384, 0.7
    )
    assert (gpqa.reward, gpqa.n_samples_per_prompt, str(gpqa.path)) == ("gpqa", 2, "/root/gpqa/gpqa_eval.jsonl")


def test_chat_eval_config_loads_every_part_with_miles_precedence() -> None:
    suite = EvalSuiteBlock.from_miles_yaml(
        CONFIGS / "chat_eval.yaml", fallbacks=SamplingFallbacks(temperature=1.0), remote_reward=JUDGE
    ).suite
    math500, dapo, gpqa, judge = suite.resolved()
    for ds in (math500, dapo, gpqa, judge):  # defaults reach every dataset unless it overrides them
        assert ds.apply_chat_template is True
        assert ds.apply_chat_template_kwargs == {"enable_thinking": False}
        assert (ds.label_key, ds.metadata_key, ds.top_k) == ("answer", "extra_info", 20)
    assert math500.path == CONFIGS / "data" / "math500.parquet"
    assert math500.system_prompt == "Please reason step by step, and put your final answer within \\boxed{}."
    assert (math500.input_key, math500.temperature, math500.n_samples_per_prompt) == ("messages", 0.6, 4)
    assert (dapo.reward, dapo.input_key, dapo.max_new_tokens, dapo.metadata_overrides) == (
        "dapo", "prompt", 8192, {"split": "test"}
    )
    assert (gpqa.reward, gpqa.temperature, gpqa.n_samples_per_prompt, gpqa.stop) == ("gpqa", 0.0, 1, ("</answer>",))
    assert (judge.reward, suite.remote_reward) == ("remote_rm", JUDGE)


def test_remote_rm_without_a_scoring_service_is_refused() -> None:
    with pytest.raises(ValueError, match=r"remote_reward: datasets \['judge'\] use reward 'remote_rm'"):
        EvalSuite.from_miles_yaml(CONFIGS / "chat_eval.yaml")


def test_delegate_datasets_named_bare_are_refused_as_miles_refuses_them() -> None:
    with pytest.raises(ValueError, match=r"^eval\.delegate\[0\]\.datasets\[0\]: must be a mapping with a name"):
        EvalSuite.from_miles_yaml(CONFIGS / "with_delegate.yaml")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"rm_type": "ifbench"}, r"eval\.datasets\[1\]\.rm_type: reward 'ifbench': not supported: IFBench"),
        ({"tool_key": ""}, r"eval\.datasets\[1\]\.tool_key: String should have at least 1"),
        ({"stop_token_ids": [151643]}, r"eval\.datasets\[1\]\.stop_token_ids: not supported"),
        ({"custom_generate_function_path": "my gen"},
         r"eval\.datasets\[1\]\.custom_generate_function_path/generate_function: String should match pattern"),
        ({"generate_tool_call_parser": "pythonic"}, r"eval\.datasets\[1\]\.generate_tool_call_parser: Input should be"),
        ({"prompt_template": "x"}, r"eval\.datasets\[1\]\.prompt_template: not supported"),
        ({"apply_chat_template_kwargs": "thinking"}, r"^eval\.datasets\[1\]\.apply_chat_template_kwargs: .*dictionary"),
        ({"metadata_key": ""}, r"^eval\.datasets\[1\]\.metadata_key: String should have at least 1"),
        ({"max_response_len": 0}, r"^eval\.datasets\[1\]\.max_response_len/max_new_tokens: Input should be greater"),
    ],
)
def test_unsupported_dataset_keys_are_refused_by_path(edit: dict, message: str) -> None:
    cfg = {
        "eval": {
            "defaults": {"max_response_len": 64},
            "datasets": [{"name": "a", "path": "/a.jsonl"}, {"name": "b", "path": "/b.jsonl", **edit}],
        }
    }
    with pytest.raises(ValueError, match=message):
        EvalSuite.from_miles_yaml(json.dumps(cfg))


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"eval": {"datasets": {"a": {"path": "/a"}}}, "rollout": {"batch": 1}}, r"^rollout: not supported next"),
        ({"eval": {"datasets": {"a": {"path": "/a"}}, "delegate": {"url": "http://x"}}}, r"^eval\.delegate: must be"),
        ({"eval": {"datasets": {"a": {"path": "/a"}}, "delegate": ["skills"]}}, r"^eval\.delegate\[0\]: must be"),
        ({"eval": {"datasets": {"a": {"path": "/a", "temprature": 0.3}}}}, r"^eval\.datasets\.a\.temprature: not"),
        ({"eval": {"defaults": {"rm_type": "math", "tool_key": 3}, "datasets": {"a": {"path": "/a"}}}},
         r"^eval\.defaults\.tool_key: Input should be a valid string"),
    ],
)
def test_unsupported_sections_are_refused_by_path(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvalSuite.from_miles_yaml(json.dumps(cfg))


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_metadata_key_reads_the_rows_metadata_object_and_applies_overrides(tmp_path: Path) -> None:
    _jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "q0", "answer": "A", "extra_info": {"choices": ["x", "y"]}, "other": 1},
            {"prompt": "q1", "answer": "B", "extra_info": json.dumps({"choices": ["z"]})},  # Parquet-style string
            {"prompt": "q2", "answer": "C", "extra_info": None},
        ],
    )
    cfg = {"datasets": [{"name": "d", "path": "d.jsonl", "label_key": "answer", "metadata_key": "extra_info",
                         "metadata_overrides": {"split": "test"}}]}
    [ds] = EvalSuite.from_miles_yaml(json.dumps(cfg), base_dir=str(tmp_path), rm_type="f1").resolved()
    assert [s.metadata for s in load_dataset(ds)] == [
        {"choices": ["x", "y"], "split": "test"},
        {"choices": ["z"], "split": "test"},
        {"split": "test"},
    ]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "q", "label": "a"}, r"dataset 'd': .*line 1: missing metadata key 'meta'"),
        ({"prompt": "q", "label": "a", "meta": [1, 2]}, r"line 1: key 'meta' must be an object"),
        ({"prompt": "q", "label": "a", "meta": "{not json"}, r"line 1: key 'meta' must be an object"),
    ],
)
def test_bad_metadata_is_named(tmp_path: Path, row: dict, message: str) -> None:
    _jsonl(tmp_path / "d.jsonl", [row])
    cfg = {"datasets": [{"name": "d", "path": "d.jsonl", "metadata_key": "meta"}]}
    [ds] = EvalSuite.from_miles_yaml(json.dumps(cfg), base_dir=str(tmp_path), rm_type="f1").resolved()
    with pytest.raises(ValueError, match=message):
        load_dataset(ds)


@given(
    st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz_"), min_size=1, max_size=24).filter(
        lambda k: k not in MILES_KEYS and k not in UNSUPPORTED_UNLESS_EMPTY
    ),
    st.sampled_from(["defaults", "datasets"]),
)
def test_any_unknown_key_is_refused_by_its_path_never_dropped(key: str, section: str) -> None:
    cfg: dict = {"eval": {"defaults": {}, "datasets": [{"name": "a", "path": "/a.jsonl"}]}}
    where = "eval.defaults" if section == "defaults" else "eval.datasets[0]"
    target = cfg["eval"]["defaults"] if section == "defaults" else cfg["eval"]["datasets"][0]
    target[key] = 1
    with pytest.raises(ValueError, match=rf"^{re.escape(where)}\.{key}: not supported"):
        EvalSuite.from_miles_yaml(json.dumps(cfg))
