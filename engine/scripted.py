"""Scripted decoding, for deterministic tests only: `--scripted-completions FILE`.

A tiny test model emits no tool calls and no useful text, so tests that need a given completion
(a `<tool_call>` block, a final answer) start the engine with a rules file:

    [{"prompt_contains": "weather in Paris", "completion": "<tool_call>\\n{...}\\n</tool_call>"}]

Contract:
- Rules are tried in file order against the request's prompt as text (its token ids decoded with
  special tokens kept, so a chat prompt is matched as the template rendered it); the first rule
  whose `prompt_contains` occurs in it wins. No rule matching: the model decodes as usual.
- A scripted sequence emits the completion's tokens (encoded without special tokens), then the
  model's EOS token, then (only under `ignore_eos`) whatever the model samples. Every other rule
  of the request still applies: `max_new_tokens`, stop strings and stop token ids cut the script
  short exactly as they would cut model output; finish reasons, logprobs (the model's logprob of
  each emitted token) and weight versions are reported as for any other request.
- The file is a JSON list of objects with exactly the string keys `prompt_contains` (non-empty)
  and `completion`; anything else is refused when the engine starts (`ScriptError`, naming the
  entry and the key). Never enable it on an engine that serves real evaluations.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.protocol import describe


class ScriptError(ValueError):
    """The rules file cannot be used; the message names the file and the bad entry."""


class ScriptRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_contains: str = Field(min_length=1)
    completion: str


def load_rules(path: str | Path) -> list[ScriptRule]:
    """The rules of a `--scripted-completions` file, validated."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ScriptError(f"--scripted-completions {path}: cannot read it ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ScriptError(f"--scripted-completions {path}: not JSON ({err})") from None
    if not isinstance(raw, list):
        raise ScriptError(f"--scripted-completions {path}: expected a JSON list of rules, got {type(raw).__name__}")
    rules = []
    for i, entry in enumerate(raw):
        try:
            rules.append(ScriptRule.model_validate(entry))
        except ValidationError as err:
            raise ScriptError(f"--scripted-completions {path}: {describe(err, f'entry {i}')}") from None
    return rules


class Script:
    """Rules plus the tokenizer that turns prompts into text and completions into tokens."""

    def __init__(self, rules: list[ScriptRule], tokenizer) -> None:
        self.rules = rules
        self.tokenizer = tokenizer

    def tokens_for(self, prompt_ids: list[int]) -> list[int] | None:
        """The token ids to emit for this prompt, or None (no rule matches)."""
        if not self.rules:
            return None
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        for rule in self.rules:
            if rule.prompt_contains in text:
                return list(self.tokenizer.encode(rule.completion, add_special_tokens=False))
        return None
