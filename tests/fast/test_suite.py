"""Eval suite config (precedence, miles YAML), builtin datasets, and the JSONL/Parquet loader."""

from __future__ import annotations

import base64
import json
import re
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from pinned_eval.scoring.rewards import get_reward
from pinned_eval.suite import (
    DatasetError,
    DatasetSpec,
    EvalSuite,
    ResolvedDataset,
    SamplingDefaults,
    SamplingFallbacks,
    default_suite,
    load_dataset,
)

MILES_MULTI_TASK = """
eval:
  defaults:
    max_response_len: 16384
    top_p: 0.7
  datasets:
    - name: aime
      path: data/aime-2024.jsonl
      rm_type: math
      n_samples_per_eval_prompt: 16
    - name: gpqa_lite
      path: /abs/gpqa.parquet
      rm_type: f1
      input_key: question
      label_key: answer
      temperature: 0.6
      max_response_len: 2048
      stop: "</answer>"
"""


def _resolved(path: Path, **kw: object) -> ResolvedDataset:
    suite = EvalSuite(datasets=(DatasetSpec(name="ds", path=str(path), **kw),))  # type: ignore[arg-type]
    return suite.resolved()[0]


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- models


@pytest.mark.parametrize(
    "model", [DatasetSpec, SamplingDefaults, SamplingFallbacks, ResolvedDataset, EvalSuite]
)
def test_models_are_frozen_strict_and_documented(model: type[BaseModel]) -> None:
    assert model.model_config.get("frozen") is True
    assert model.model_config.get("extra") == "forbid"
    undocumented = [name for name, f in model.model_fields.items() if not f.description]
    assert undocumented == []


def test_extra_field_rejected_by_name() -> None:
    with pytest.raises(ValidationError, match="n_samples_per_eval_prompt"):
        DatasetSpec(name="a", path="a.jsonl", n_samples_per_eval_prompt=2)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "eval/x"}, "name"),
        ({"n_samples_per_prompt": 0}, "n_samples_per_prompt"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"reward": "bleu"}, "reward"),
        ({"reward": "custom:not a path"}, "reward"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_dataset_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    fields = {"name": "ds", "path": "x.jsonl", **kwargs}
    with pytest.raises(ValidationError) as info:
        DatasetSpec(**fields)  # type: ignore[arg-type]
    assert info.value.errors()[0]["loc"] == (field,)


def test_duplicate_dataset_names_rejected() -> None:
    with pytest.raises(ValidationError, match=r"duplicate dataset name\(s\) \['a'\]"):
        EvalSuite(datasets=(DatasetSpec(name="a", path="1.jsonl"), DatasetSpec(name="a", path="2.jsonl")))


# ---------------------------------------------------------------------------- precedence

_LEVEL_VALUES = {
    "input_key": ("q_ds", "q_def", "q_fb"),
    "label_key": ("a_ds", "a_def", "a_fb"),
    "n_samples_per_prompt": (8, 4, 2),
    "temperature": (0.3, 0.5, 0.9),
    "top_p": (0.5, 0.7, 0.9),
    "top_k": (5, 10, 20),
    "max_new_tokens": (16, 32, 64),
    "stop": (("a",), ("b",), ("c",)),
    "reward": ("f1", "math", "exact_match"),
    "max_prompts": (3, 5, 7),
    "apply_chat_template": (True, False, True),
}


@pytest.mark.parametrize("field", sorted(_LEVEL_VALUES))
def test_precedence_dataset_over_defaults_over_fallbacks(field: str) -> None:
    ds_v, def_v, fb_v = _LEVEL_VALUES[field]
    fallbacks = SamplingFallbacks(**{field: fb_v})
    suite = EvalSuite(
        datasets=(
            DatasetSpec(name="set", path="x.jsonl", **{field: ds_v}),
            DatasetSpec(name="unset", path="x.jsonl"),
        ),
        defaults=SamplingDefaults(**{field: def_v}),
        fallbacks=fallbacks,
    )
    by_name = {d.name: d for d in suite.resolved()}
    assert getattr(by_name["set"], field) == ds_v
    assert getattr(by_name["unset"], field) == def_v
    only_fallbacks = EvalSuite(datasets=(DatasetSpec(name="bare", path="x.jsonl"),), fallbacks=fallbacks)
    assert getattr(only_fallbacks.resolved()[0], field) == fb_v


def test_fallback_defaults_match_miles() -> None:
    r = EvalSuite(datasets=(DatasetSpec(name="d", path="x.jsonl"),)).resolved()[0]
    assert (r.input_key, r.label_key, r.n_samples_per_prompt, r.apply_chat_template) == (
        "prompt",
        "label",
        1,
        False,
    )
    assert r.sampling_params() == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 1024,
        "stop": [],
    }


def test_paths_resolve_against_base_dir_and_builtin(tmp_path: Path) -> None:
    suite = EvalSuite(
        datasets=(
            DatasetSpec(name="rel", path="sub/a.jsonl"),
            DatasetSpec(name="abs", path=str(tmp_path / "b.jsonl")),
            DatasetSpec(name="pkg", path="builtin:arith_add.jsonl"),
        ),
        base_dir=str(tmp_path),
    )
    rel, abs_, pkg = suite.resolved()
    assert rel.path == tmp_path / "sub" / "a.jsonl"
    assert abs_.path == tmp_path / "b.jsonl"
    assert pkg.path.is_file() and pkg.path.parent.name == "builtin"


# ---------------------------------------------------------------------------- miles YAML


def test_miles_yaml_maps_keys_and_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(MILES_MULTI_TASK)
    suite = EvalSuite.from_miles_yaml(cfg, fallbacks=SamplingFallbacks(temperature=1.0), pass_at_k=True)
    aime, gpqa = suite.resolved()
    assert suite.pass_at_k is True
    assert aime.path == tmp_path / "data" / "aime-2024.jsonl"
    assert (aime.reward, aime.n_samples_per_prompt, aime.max_new_tokens, aime.top_p) == (
        "math",
        16,
        16384,
        0.7,
    )
    assert (aime.temperature, aime.input_key, aime.label_key) == (1.0, "prompt", "label")
    assert gpqa.path == Path("/abs/gpqa.parquet")
    assert (gpqa.reward, gpqa.input_key, gpqa.label_key, gpqa.temperature) == (
        "f1",
        "question",
        "answer",
        0.6,
    )
    assert (gpqa.max_new_tokens, gpqa.stop, gpqa.n_samples_per_prompt) == (2048, ("</answer>",), 1)


def test_miles_yaml_mapping_form_text_and_base64() -> None:
    text = "datasets:\n  gsm8k: {path: g.jsonl, rm_type: math}\n  squad: {path: s.jsonl, rm_type: f1}\n"
    for source in (text, "base64:" + base64.b64encode(text.encode()).decode()):
        suite = EvalSuite.from_miles_yaml(source, base_dir="/data")
        assert [(d.name, d.reward, str(d.path)) for d in suite.resolved()] == [
            ("gsm8k", "math", "/data/g.jsonl"),
            ("squad", "f1", "/data/s.jsonl"),
        ]


def test_miles_yaml_accepts_json_and_custom_reward() -> None:
    text = json.dumps(
        {"eval": {"datasets": [{"name": "c", "path": "/c.jsonl", "reward": "custom:pkg.mod:fn"}]}}
    )
    assert EvalSuite.from_miles_yaml(text).resolved()[0].reward == "custom:pkg.mod:fn"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("eval:\n  datasets: []\n", r"eval\.datasets: no datasets"),
        ("- a\n- b\n", "root must be a mapping"),
        ("eval:\n  datasets:\n    - path: a.jsonl\n", r"eval\.datasets\[0\]\.name: required"),
        (
            "eval:\n  datasets:\n    - {name: a, path: a.jsonl, generate_max_turns: 0}\n",
            r"eval\.datasets\[0\]\.generate_max_turns",
        ),
        (
            "eval:\n  datasets:\n    - {name: a, path: a.jsonl, rm_type: ifbench}\n",
            r"eval\.datasets\[0\]\.rm_type",
        ),
        (
            "eval:\n  defaults: {min_new_tokens: 3}\n  datasets: {a: {path: a}}\n",
            r"eval\.defaults\.min_new_tokens",
        ),
        ("eval:\n  datasets: {a: {path: a}}\n  interval: 3\n", r"eval\.interval: not supported"),
        ("eval:\n  datasets:\n    - {name: a, path: a, max_response_len: 4, max_new_tokens: 5}\n", "twice"),
        (
            "eval:\n  datasets:\n    - {name: a, path: a, n_samples_per_eval_prompt: 0}\n",
            "n_samples_per_prompt",
        ),
        ("eval: [unclosed\n", "not valid YAML"),
    ],
)
def test_miles_yaml_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvalSuite.from_miles_yaml(text)


def test_miles_yaml_missing_file_named() -> None:
    with pytest.raises(FileNotFoundError, match=r"nope/eval\.yaml"):
        EvalSuite.from_miles_yaml("nope/eval.yaml")


# ---------------------------------------------------------------------------- builtin datasets


def test_default_suite_resolves_the_demo_sets() -> None:
    greedy = default_suite().resolved()
    assert [d.name for d in greedy] == ["arith_add", "arith_sub"]
    for d in greedy:
        assert (d.temperature, d.n_samples_per_prompt, d.max_new_tokens, d.reward) == (
            0.0,
            1,
            4,
            "exact_match",
        )
    sampled = default_suite(with_pass_at_k=True)
    assert sampled.pass_at_k is True
    extra = sampled.resolved()[-1]
    assert (extra.n_samples_per_prompt, extra.temperature, extra.max_new_tokens) == (4, 0.8, 4)


@pytest.mark.parametrize(("name", "op"), [("arith_add", "+"), ("arith_sub", "-")])
def test_arith_datasets_are_exact_and_correct(name: str, op: str) -> None:
    ds = next(d for d in default_suite().resolved() if d.name == name)
    samples = load_dataset(ds)
    assert 60 <= len(samples) <= 70
    assert len({s.prompt for s in samples}) == len(samples)
    for s in samples:
        assert isinstance(s.prompt, str)
        m = re.fullmatch(rf"(\d+){re.escape(op)}(\d)=", s.prompt)
        assert m, s.prompt
        a, b = int(m.group(1)), int(m.group(2))
        assert s.label == str(a + b if op == "+" else a - b)
        assert re.fullmatch(r"\d+", s.label)
        if op == "+":
            assert a <= 9


def test_math_boxed_dataset_labels_are_numbers_and_gradeable() -> None:
    ds = EvalSuite(
        datasets=(DatasetSpec(name="m", path="builtin:math_boxed.jsonl", reward="math"),)
    ).resolved()[0]
    samples = load_dataset(ds)
    assert 30 <= len(samples) <= 34
    grade = get_reward(ds.reward)
    for s in samples:
        float(s.label)
        assert grade(f"so the answer is $\\boxed{{{s.label}}}$.", s.label) == 1.0
        assert grade(f"\\boxed{{{float(s.label) + 1}}}", s.label) == 0.0


# ---------------------------------------------------------------------------- loader


def test_jsonl_loader_labels_metadata_and_cap(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"q": "1+1=", "a": 2, "src": "x"}, {"q": "2+2=", "a": "4"}])
    path.write_text(path.read_text() + "\n\n" + json.dumps({"q": "3+3=", "a": 6.5}) + "\n")
    samples = load_dataset(_resolved(path, input_key="q", label_key="a"))
    assert [(s.index, s.prompt, s.label, s.metadata) for s in samples] == [
        (0, "1+1=", 2, {"src": "x"}),
        (1, "2+2=", "4", {}),
        (2, "3+3=", 6.5, {}),
    ]
    assert [s.prompt for s in load_dataset(_resolved(path, input_key="q", label_key="a", max_prompts=2))] == [
        "1+1=",
        "2+2=",
    ]


def test_parquet_loader(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"prompt": "p0", "label": "l0", "k": 1}, {"prompt": "p1", "label": "l1", "k": 2}]
        ),
        path,
    )
    samples = load_dataset(_resolved(path))
    assert [(s.index, s.prompt, s.label, s.metadata) for s in samples] == [
        (0, "p0", "l0", {"k": 1}),
        (1, "p1", "l1", {"k": 2}),
    ]


def test_chat_messages_need_apply_chat_template(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "label": "x"}])
    assert load_dataset(_resolved(path, apply_chat_template=True))[0].prompt == [
        {"role": "user", "content": "hi"}
    ]
    with pytest.raises(DatasetError, match=r"c\.jsonl: line 1: key 'prompt' must be a string, got list"):
        load_dataset(_resolved(path))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a", "label": "b"}\n{"prompt": "c"}\n', r"bad\.jsonl: line 2: missing key 'label'"),
        ('{"prompt": "a", "label": "b"}\n\n{"prompt": "c", "label": \n', r"bad\.jsonl: line 3: invalid JSON"),
        ('["prompt", "label"]\n', r"bad\.jsonl: line 1: expected an object, got list"),
        ('{"prompt": "a", "label": [1]}\n',
         r"bad\.jsonl: line 1: key 'label' is a JSON list; reward 'exact_match' needs a string"),
        ('{"prompt": "a", "label": true}\n', r"bad\.jsonl: line 1: key 'label'"),
        ('{"prompt": 3, "label": "x"}\n', r"bad\.jsonl: line 1: key 'prompt' must be a string"),
        ("\n\n", r"bad\.jsonl: dataset 'ds' has no rows"),
    ],
)
def test_jsonl_errors_name_file_line_and_key(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_dataset(_resolved(path))


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"missing\.jsonl: dataset file not found"):
        load_dataset(_resolved(tmp_path / "missing.jsonl"))
    (tmp_path / "d.csv").write_text("prompt,label\n")
    with pytest.raises(DatasetError, match=r"d\.csv: unsupported extension"):
        load_dataset(_resolved(tmp_path / "d.csv"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match=r"broken\.parquet: cannot read Parquet"):
        load_dataset(_resolved(tmp_path / "broken.parquet"))
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "answer": "a"}]), tmp_path / "cols.parquet")
    with pytest.raises(DatasetError, match=r"cols\.parquet: row 0: missing key 'label'"):
        load_dataset(_resolved(tmp_path / "cols.parquet"))


# ---------------------------------------------------------------------------- property-based

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_label = st.one_of(_text, st.integers(-(10**12), 10**12))
_rows = st.lists(st.tuples(_text, _label, st.integers(0, 1000)), min_size=1, max_size=30)


@settings(max_examples=40, deadline=None)
@given(rows=_rows, cap=st.none() | st.integers(1, 40))
def test_jsonl_round_trip_random_rows(rows: list[tuple[str, str | int, int]], cap: int | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_jsonl(
            Path(tmp) / "r.jsonl", [{"prompt": p, "label": lab, "extra": e} for p, lab, e in rows]
        )
        samples = load_dataset(_resolved(path, max_prompts=cap))
    expected = rows[:cap] if cap else rows
    assert [(s.index, s.prompt, s.label, s.metadata) for s in samples] == [
        (i, p, lab, {"extra": e}) for i, (p, lab, e) in enumerate(expected)  # labels keep their JSON type
    ]


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.tuples(_text, _text), min_size=1, max_size=30))
def test_parquet_round_trip_random_rows(rows: list[tuple[str, str]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.parquet"
        pq.write_table(pa.Table.from_pylist([{"q": p, "a": lab} for p, lab in rows]), path)
        samples = load_dataset(_resolved(path, input_key="q", label_key="a"))
    assert [(s.prompt, s.label) for s in samples] == rows


@settings(max_examples=40, deadline=None)
@given(rows=_rows, data=st.data())
def test_missing_key_on_random_row_is_named(
    rows: list[tuple[str, str | int, int]], data: st.DataObject
) -> None:
    bad = data.draw(st.integers(0, len(rows) - 1))
    dropped = data.draw(st.sampled_from(["prompt", "label"]))
    dicts: list[dict[str, object]] = [{"prompt": p, "label": lab, "extra": e} for p, lab, e in rows]
    del dicts[bad][dropped]
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_jsonl(Path(tmp) / "r.jsonl", list(dicts))
        with pytest.raises(DatasetError, match=rf"r\.jsonl: line {bad + 1}: missing key '{dropped}'"):
            load_dataset(_resolved(path))


def test_miles_config_file_with_any_extension(tmp_path: Path) -> None:
    cfg = tmp_path / "eval.conf"
    cfg.write_text("eval:\n  datasets:\n    - {name: a, path: a.jsonl}\n")
    assert EvalSuite.from_miles_yaml(str(cfg), rm_type="math").resolved()[0].path == tmp_path / "a.jsonl"
