"""`miles.utils.misc` as pinned-eval serves it: `load_function`.

`load_function(path)` imports `module.submodule.attr` (split at the last '.', miles' form) through
`pinned_eval.plugins`; an empty path gives None; any attribute (a list of tool specs too) is
returned. Failures raise `ImportError` naming the path.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["load_function"]


def load_function(path: str | None, *, sync_required: bool = False) -> Any:
    if not path:
        return None
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ImportError(f"load_function: {path!r} is not 'module.attr'")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise ImportError(f"load_function: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)
