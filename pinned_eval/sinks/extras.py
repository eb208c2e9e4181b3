"""Optional trackers are extras: a sinks block that needs one that is not installed is refused
when it loads (`missing_extra`), not when the first point logs."""

from __future__ import annotations

import importlib.util


def missing_extra(module: str, extra: str) -> str | None:
    """None when `module` can be imported, else the refusal naming the extra to install. Cheap:
    finds the module without importing it (MLflow's import takes seconds)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken entry in sys.modules
        found = False
    if found:
        return None
    return f"needs the optional package {module!r}: pip install 'pinned-eval[{extra}]'"
