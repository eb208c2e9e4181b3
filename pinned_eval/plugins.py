"""The one loader of code a configuration names by import path (`module:attr` or `module.attr`).

Custom rewards (`custom:<path>`) and external backends (`ExternalBackendBlock.backend`) use it;
generate functions, harnesses and exporters will. Contract:
- `ImportPath`: the annotated type of a field holding such a path; one pattern
  (`IMPORT_PATH_PATTERN`): a dotted module name, then `:attr` or `.attr`. Saving a path imports
  nothing.
- `is_import_path(text)`: the same check in Python (a trailing newline is refused, as pydantic does).
- `load_object(path, expect=..., what=...)` imports the module and returns the attribute. Every
  failure is one `PluginError` (a `ValueError`) whose message starts with `what` (how the user
  names the thing, e.g. "backend 'pkg:Cls'"): a malformed path, a module that cannot be imported
  (the cause chained), a missing attribute; an object of the wrong kind is `PluginTypeError` (also
  a `TypeError`). `expect` is `callable` (the attribute must be callable: a missing one "has no
  callable") or a class (the attribute must be that class or a subclass of it).
This module imports nothing of the project.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import StringConstraints

__all__ = [
    "IMPORT_PATH_PATTERN",
    "ImportPath",
    "PluginError",
    "PluginTypeError",
    "is_import_path",
    "load_object",
    "split_import_path",
]

IMPORT_PATH_PATTERN = r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*|\.[A-Za-z_]\w*)$"  # pydantic: `$` ends the text
_IMPORT_PATH_RE = re.compile(IMPORT_PATH_PATTERN.removesuffix("$") + r"\Z")  # Python's `$` allows a final \n

ImportPath = Annotated[str, StringConstraints(pattern=IMPORT_PATH_PATTERN)]


class PluginError(ValueError):
    """An import path that names no usable object; the message names it as the user does."""


class PluginTypeError(PluginError, TypeError):
    """The path names an object of the wrong kind (not callable, not the expected class)."""


def is_import_path(text: str) -> bool:
    """Whether `text` is `module:attr` or `module.attr` (`IMPORT_PATH_PATTERN`)."""
    return bool(_IMPORT_PATH_RE.match(text))


def split_import_path(path: str) -> tuple[str, str]:
    """(module, attribute) of a valid import path: split at the ':' if there is one, else at the
    last '.'. `ValueError` for a malformed path."""
    if not is_import_path(path):
        raise ValueError(f"{path!r} is not 'module:attr' or 'module.attr'")
    module, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    return module, attr


def load_object(path: str, *, expect: type | Callable[[Any], bool], what: str) -> Any:
    """Import `path` and return its attribute, checked against `expect` (see the module docstring)."""
    word = "Class" if inspect.isclass(expect) else "function"
    if not is_import_path(path):
        raise PluginError(f"{what}: {path!r} is not 'module:{word}' or 'module.{word}'")
    module_name, attr = split_import_path(path)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{what}: cannot import module {module_name!r} ({exc})") from exc
    noun = "callable" if expect is callable else "attribute"
    if not hasattr(module, attr):
        raise PluginError(f"{what}: module {module_name!r} has no {noun} {attr!r}")
    obj = getattr(module, attr)
    if inspect.isclass(expect):
        if not (inspect.isclass(obj) and issubclass(obj, expect)):
            raise PluginTypeError(f"{what}: {path!r} is not a {expect.__name__} subclass")
    elif not expect(obj):
        raise PluginTypeError(f"{what}: module {module_name!r} has no {noun} {attr!r}")
    return obj
