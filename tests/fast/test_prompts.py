"""Prompt rendering: the chat template of a real (Jinja, ChatML) tokenizer saved next to the weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from pinned_eval.prompts import PromptError, PromptRenderer, load_tokenizer
from pinned_eval.suite import DatasetSpec, EvalSample, EvalSuite, ResolvedDataset

IM_START_ID = 3  # engine.tiny_model: <|im_start|>, <|im_end|> are special tokens 3 and 4
BOS_ID = 1


@pytest.fixture(scope="module")
def chatml_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("chatml") / "model", chat_template="chatml")


def _ds(**fields: object) -> ResolvedDataset:
    spec = DatasetSpec(name="chat", path="/data/chat.jsonl", **fields)  # type: ignore[arg-type]
    [ds] = EvalSuite(datasets=(spec,)).resolved()
    return ds


def _template_file(model: Path) -> Path:
    jinja = model / "chat_template.jinja"
    return jinja if jinja.is_file() else model / "tokenizer_config.json"


def _set_template(model: Path, template: str) -> None:
    jinja = model / "chat_template.jinja"
    if jinja.is_file():
        jinja.write_text(template)
    else:
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (model / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_plain_string_prompt_is_sent_as_text_unchanged() -> None:
    rendered = PromptRenderer(None).render(_ds(), EvalSample(0, "2+3=", "5"))
    assert (rendered.text, rendered.input_ids) == ("2+3=", None)
    assert rendered.request() == {"prompt": "2+3="}


def test_message_list_without_template_names_dataset_and_key() -> None:
    sample = EvalSample(4, [{"role": "user", "content": "hi"}], "x")
    with pytest.raises(PromptError, match=r"dataset 'chat' row 4: 'messages' is a message list.*apply_chat_template"):
        PromptRenderer(None).render(_ds(input_key="messages"), sample)


def test_string_prompt_gets_system_prompt_and_chatml_template(chatml_model: Path) -> None:
    ds = _ds(apply_chat_template=True, system_prompt="Be terse.")
    rendered = PromptRenderer(chatml_model).render(ds, EvalSample(0, "2+3=", "5"))
    assert rendered.text == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
    )
    tok = load_tokenizer(chatml_model)
    assert rendered.input_ids == list(tok.encode(rendered.text, add_special_tokens=False))
    assert rendered.input_ids[0] == IM_START_ID and BOS_ID not in rendered.input_ids  # no BOS added twice
    assert rendered.request() == {"input_ids": rendered.input_ids}


def test_message_list_keeps_its_own_system_message_and_passes_template_kwargs(chatml_model: Path) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    ds = _ds(apply_chat_template=True, system_prompt="ignored", apply_chat_template_kwargs={"enable_thinking": False})
    rendered = PromptRenderer(chatml_model).render(ds, EvalSample(0, messages, "x"))
    assert rendered.text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "row not mutated"


@pytest.mark.parametrize(
    ("template", "detail"),
    [
        ("{{ raise_exception('this template refuses system messages') }}", "refuses system messages"),
        ("{% for m in messages %}{{ m['content'] | no_such_filter }}{% endfor %}", "no_such_filter"),
        ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
    ],
)
def test_template_that_fails_to_render_names_the_dataset(
    chatml_model: Path, tmp_path: Path, template: str, detail: str
) -> None:
    broken = Path(shutil.copytree(chatml_model, tmp_path / "broken"))
    _set_template(broken, template)
    with pytest.raises(PromptError, match=rf"dataset 'chat' row 2: the chat template failed to render.*{detail}"):
        PromptRenderer(broken).render(_ds(apply_chat_template=True), EvalSample(2, "hi", "x"))


def test_tokenizer_without_template_or_without_checkpoint_is_named(chatml_model: Path, tmp_path: Path) -> None:
    bare = Path(shutil.copytree(chatml_model, tmp_path / "bare"))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    ds = _ds(apply_chat_template=True)
    with pytest.raises(PromptError, match=r"dataset 'chat': apply_chat_template is set but the tokenizer .* no chat"):
        PromptRenderer(bare).render(ds, EvalSample(0, "hi", "x"))
    with pytest.raises(PromptError, match=r"dataset 'chat': apply_chat_template needs the model's tokenizer"):
        PromptRenderer(None).render(ds, EvalSample(0, "hi", "x"))
    with pytest.raises(PromptError, match=r"tokenizer: .*missing is not a directory"):
        PromptRenderer(tmp_path / "missing").render(ds, EvalSample(0, "hi", "x"))


def test_tokenizer_is_cached_per_snapshot_until_its_files_change(chatml_model: Path, tmp_path: Path) -> None:
    snap = Path(shutil.copytree(chatml_model, tmp_path / "step_3"))
    first = load_tokenizer(snap)
    assert load_tokenizer(snap) is first, "one load per snapshot path"
    assert load_tokenizer(chatml_model) is not first, "another snapshot path loads its own"
    _set_template(snap, "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    stat = _template_file(snap).stat()
    os.utime(_template_file(snap), ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    changed = PromptRenderer(snap).render(_ds(apply_chat_template=True), EvalSample(0, "hi", "x"))
    assert changed.text == "[hi]", "a rewritten tokenizer is read again"
