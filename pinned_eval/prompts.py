"""The one place a dataset row becomes the prompt an engine receives (every posture uses it).

Contract of `PromptRenderer(tokenizer_dir).render(ds, sample) -> RenderedPrompt`:
- `ds.apply_chat_template` false: the row's prompt must be a string and is sent as `text`,
  unchanged (a message list is a `PromptError` naming the dataset and `input_key`).
- `ds.apply_chat_template` true: a string prompt becomes `[{"role": "user", "content": prompt}]`;
  `ds.system_prompt`, when set and the messages do not already start with a system message, is
  prepended as one. The messages are rendered with the chat template of the tokenizer saved in
  `tokenizer_dir` (the pinned snapshot: its `tokenizer_config.json` / `chat_template.jinja`):
  `apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
  **ds.apply_chat_template_kwargs)`, plus `tools=<the row's tools>` when the row has tools
  (miles' `tool_key`, `pinned_eval.datasets.loader`), as miles' `Dataset` renders them.
  The text is tokenized with `add_special_tokens=False` and sent as `input_ids`
  (miles does the same: the template already holds any BOS, so the engine must not add another).
  A template that fails to render, or a tokenizer without a template, is a `PromptError` naming the dataset.
- Tokenizers load lazily (only when a dataset needs the template) and are cached per snapshot
  path and tokenizer-file mtimes, so each pinned snapshot is read once per process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.datasets.spec import ResolvedDataset

_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja", "chat_template.json")


class PromptError(ValueError):
    """A prompt that cannot be rendered; the message names the dataset, row and key or template."""


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """What one request carries: `text` always (for records), `input_ids` when templated."""

    text: str
    input_ids: list[int] | None = None

    def request(self) -> dict[str, Any]:
        """Keyword arguments of `build_generate_body` / `FleetClient.generate` (text XOR ids)."""
        return {"input_ids": self.input_ids} if self.input_ids is not None else {"prompt": self.text}


def load_tokenizer(path: str | Path) -> Any:
    """The HF tokenizer saved in `path`, cached per (path, tokenizer files' mtimes)."""
    resolved = Path(path).expanduser().resolve()
    stamps = tuple(_mtime(resolved / name) for name in _TOKENIZER_FILES)
    return _cached_tokenizer(str(resolved), stamps)


def _mtime(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return 0


@lru_cache(maxsize=8)
def _cached_tokenizer(path: str, stamps: tuple[int, ...]) -> Any:
    from transformers import AutoTokenizer  # heavy: imported only when a template is needed

    if not Path(path).is_dir():
        raise PromptError(f"tokenizer: {path} is not a directory (the snapshot has no tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise PromptError(f"tokenizer: cannot load the tokenizer saved in {path}: {exc}") from exc


class PromptRenderer:
    """Renders rows for one weight version; `tokenizer_dir` is the pinned snapshot (or None)."""

    def __init__(self, tokenizer_dir: str | Path | None) -> None:
        self.tokenizer_dir = tokenizer_dir

    def render(self, ds: ResolvedDataset, sample: EvalSample) -> RenderedPrompt:
        where = f"dataset {ds.name!r} row {sample.index}"
        if not ds.apply_chat_template:
            if not isinstance(sample.prompt, str):
                raise PromptError(
                    f"{where}: {ds.input_key!r} is a message list; set apply_chat_template to render it"
                )
            return RenderedPrompt(text=sample.prompt)
        messages = self.messages(ds, sample)
        tokenizer = self._tokenizer(ds)
        from jinja2 import TemplateError

        tools = {"tools": sample.tools} if sample.tools is not None else {}
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **tools, **ds.apply_chat_template_kwargs
            )
        except (TemplateError, TypeError, ValueError, KeyError) as exc:  # syntax, undefined, raise_exception
            raise PromptError(f"{where}: the chat template failed to render: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise PromptError(f"{where}: the chat template rendered {type(text).__name__}, not text")
        return RenderedPrompt(text=text, input_ids=list(tokenizer.encode(text, add_special_tokens=False)))

    @staticmethod
    def messages(ds: ResolvedDataset, sample: EvalSample) -> list[dict[str, Any]]:
        """The conversation a templated row renders: user turn from a string, system prompt first."""
        prompt = sample.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if ds.system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": ds.system_prompt})
        return messages

    def _tokenizer(self, ds: ResolvedDataset) -> Any:
        if self.tokenizer_dir is None:
            raise PromptError(
                f"dataset {ds.name!r}: apply_chat_template needs the model's tokenizer, and this "
                "point has no checkpoint directory to read it from"
            )
        tokenizer = load_tokenizer(self.tokenizer_dir)
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(
                f"dataset {ds.name!r}: apply_chat_template is set but the tokenizer in "
                f"{self.tokenizer_dir} has no chat template"
            )
        return tokenizer
