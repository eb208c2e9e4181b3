"""Pydantic validation errors in the words of the command line: the one place the CLI formats them.

`human_errors(exc, flags)` turns each error of a `ValidationError` into `<flag>: <message>`:
- the field path is replaced by the flag that set it (`hf_base` → `--hf-base`), else written
  dotted (`datasets.0.path`); a model-level error (empty path) has no prefix at all, so no `: :`;
- pydantic's `Value error, ` / `Assertion failed, ` prefixes are dropped;
- a field named in the message (`` `hf_base` `` or a leading `hf_base: `) is renamed to its flag too.
Errors are joined with `; `, in pydantic's order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pydantic import ValidationError

_PYDANTIC_PREFIX = re.compile(r"^(Value error|Assertion failed), ")


def _rename(text: str, flags: Mapping[str, str]) -> str:
    for field, flag in flags.items():
        text = text.replace(f"`{field}`", f"`{flag}`")
        if text.startswith(f"{field}: "):
            text = f"{flag}: " + text.removeprefix(f"{field}: ")
    return text


def human_error(loc: tuple[int | str, ...], msg: str, flags: Mapping[str, str] | None = None) -> str:
    """One error as `<flag or dotted path>: <message>` (just the message when `loc` is empty)."""
    flags = flags or {}
    path = ".".join(map(str, loc))
    where = flags.get(path) or (flags.get(str(loc[-1])) if loc else None) or path
    text = _rename(_PYDANTIC_PREFIX.sub("", msg), flags)
    return f"{where}: {text}" if where and not text.startswith(f"{where}: ") else text


def human_errors(exc: ValidationError, flags: Mapping[str, str] | None = None) -> str:
    """Every error of `exc`, formatted by `human_error`, joined with `; `."""
    return "; ".join(human_error(tuple(e["loc"]), e["msg"], flags) for e in exc.errors())
