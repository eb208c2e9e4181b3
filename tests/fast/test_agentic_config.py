"""Agentic dataset config: miles' custom_generate_function_path (per dataset and the suite default),
tool_key (a row's tools reach metadata and the chat template), the generate-function extension keys,
and the suite-load dry import of user code (in a subprocess)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pinned_eval.datasets.loader import DatasetError, load_dataset
from pinned_eval.prompts import PromptRenderer
from pinned_eval.rollout import rollout_kind
from pinned_eval.suite import DatasetSpec, EvalSuite

FIXTURES = Path(__file__).parent.parent / "fixtures" / "miles_style"
TOOLS = [{"type": "function", "function": {"name": "search", "description": "web", "parameters": {"type": "object"}}}]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _miles(tmp_path: Path, datasets: list[dict], **kw: object) -> EvalSuite:
    cfg = {"eval": {"defaults": {"rm_type": "math"}, "datasets": datasets}}
    kw.setdefault("base_dir", str(tmp_path))
    return EvalSuite.from_miles_yaml(json.dumps(cfg), **kw)  # type: ignore[arg-type]


def _gen(name: str, path: str) -> dict:
    return {"name": name, "path": f"{name}.jsonl", "custom_generate_function_path": path}


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))


def test_generate_function_per_dataset_and_suite_default_choose_the_function_rollout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(FIXTURES)  # the dry import resolves user modules from the suite's base_dir
    suite = EvalSuite.from_miles_yaml(
        json.dumps({"eval": {"defaults": {"rm_type": "math"}, "datasets": [
            {"name": "own", "path": "a.jsonl", "custom_generate_function_path": "echo_old.generate"},
            {"name": "plain", "path": "b.jsonl"},
        ]}}),
        base_dir=str(FIXTURES),
        custom_generate_function_path="multi_agent_style.generate_with_multi_agents",
    )
    own, plain = suite.resolved()
    assert (own.generate_function, own.rollout) == ("echo_old.generate", "function")
    assert (plain.generate_function, plain.rollout) == ("multi_agent_style.generate_with_multi_agents", "function")
    assert rollout_kind(own) == "function"
    [single] = EvalSuite(datasets=(DatasetSpec(name="s", path="/s.jsonl"),)).resolved()
    assert (single.generate_function, single.rollout, single.tool_key) == (None, "single_turn", "tools")


def test_extension_keys_are_accepted_and_refused_under_strict_miles(tmp_path: Path) -> None:
    ds = {"name": "r", "path": "r.jsonl", "generate_max_turns": 3, "generate_tool_call_parser": "qwen25",
          "generate_tool_specs_path": "pkg.tools.tool_specs", "custom_agent_function_path": "pkg.agent.run"}
    [resolved] = _miles(tmp_path, [ds], check_imports=False).resolved()
    assert (resolved.generate_max_turns, resolved.generate_tool_call_parser) == (3, "qwen25")
    assert (resolved.generate_tool_specs_path, resolved.custom_agent_function_path) == (
        "pkg.tools.tool_specs", "pkg.agent.run")
    for key in ("generate_max_turns", "generate_tool_call_parser", "generate_tool_specs_path",
                "custom_agent_function_path"):
        with pytest.raises(ValueError, match=rf"^eval\.datasets\[0\]\.{key}: a pinned-eval extension"):
            _miles(tmp_path, [{"name": "r", "path": "r.jsonl", key: ds[key]}], strict_miles=True)
    # miles' own keys load strictly
    strict = _miles(tmp_path, [{"name": "r", "path": "r.jsonl", "tool_key": "fns"}], strict_miles=True)
    assert strict.resolved()[0].tool_key == "fns"


def test_a_miles_import_outside_the_surface_is_refused_at_load_naming_the_module(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=(
        r"^dataset 'x': 'uses_ray_rollout\.generate': .*miles module 'miles\.ray' is not in "
        r"pinned-eval's miles-compatible surface \(miles\.utils\.types, ")):
        _miles(tmp_path, [_gen("x", "uses_ray_rollout.generate")], base_dir=str(FIXTURES))
    with pytest.raises(ValueError, match=r"^dataset 'y': 'no_such_module\.generate': .*No module named 'no_such_mod"):
        _miles(tmp_path, [_gen("y", "no_such_module.generate")], base_dir=str(FIXTURES))
    with pytest.raises(ValueError, match=r"^dataset 'z': 'echo_old\.nope': .*module 'echo_old' has no attribute 'nop"):
        _miles(tmp_path, [_gen("z", "echo_old.nope")], base_dir=str(FIXTURES))
    import sys

    assert "miles" not in sys.modules  # the check never ran user code (or the surface) here


def test_bad_suite_default_generate_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--custom-generate-function-path: 'not a path' is not 'module\.function'"):
        _miles(tmp_path, [{"name": "a", "path": "a.jsonl"}], custom_generate_function_path="not a path")


def test_rows_tools_reach_metadata_as_a_list(tmp_path: Path) -> None:
    _jsonl(tmp_path / "t.jsonl", [
        {"prompt": "p0", "label": "1", "tools": TOOLS},
        {"prompt": "p1", "label": "2", "tools": json.dumps(TOOLS)},  # a JSON string, as Parquet exports hold
        {"prompt": "p2", "label": "3"},
        {"prompt": "p3", "label": "4", "fns": TOOLS, "tools": None},
    ])
    [ds] = _miles(tmp_path, [{"name": "t", "path": "t.jsonl"}]).resolved()
    rows = load_dataset(ds)
    assert [r.tools for r in rows] == [TOOLS, TOOLS, None, None]
    assert rows[1].metadata == {"tools": TOOLS}
    assert "tools" not in rows[2].metadata
    [custom] = _miles(tmp_path, [{"name": "t", "path": "t.jsonl", "tool_key": "fns"}]).resolved()
    assert load_dataset(custom)[3].tools == TOOLS


def test_tools_that_are_not_a_list_name_the_row_and_key(tmp_path: Path) -> None:
    _jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "label": "1", "tools": {"name": "x"}}])
    [ds] = _miles(tmp_path, [{"name": "bad", "path": "bad.jsonl"}]).resolved()
    with pytest.raises(DatasetError, match=r"line 1: key 'tools' \(tool_key\) must be a list of tool specs"):
        load_dataset(ds)


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_reach_the_chat_template_as_miles_renders_them(tmp_path: Path) -> None:
    from engine.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", chat_template="chatml")
    jinja = model / "chat_template.jinja"
    if jinja.is_file():
        jinja.write_text(TOOL_TEMPLATE)
    else:
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        cfg["chat_template"] = TOOL_TEMPLATE
        (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    _jsonl(tmp_path / "t.jsonl", [{"prompt": "hi", "label": "1", "tools": TOOLS}, {"prompt": "yo", "label": "2"}])
    [ds] = _miles(tmp_path, [{"name": "t", "path": "t.jsonl", "apply_chat_template": True}]).resolved()
    with_tools, without = load_dataset(ds)
    renderer = PromptRenderer(model)
    expected = "TOOLS:search\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.render(ds, with_tools).text == expected
    assert renderer.render(ds, without).text == "<|im_start|>user\nyo<|im_end|>\n<|im_start|>assistant\n"
    shutil.rmtree(model)
