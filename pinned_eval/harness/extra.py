"""Whether the optional extra `pinned-eval[harness]` is installed (lm-eval and its API client).

`require_lm_eval(where)` raises `ValueError` naming `where` and the extra when a package is
missing; it imports nothing (a suite loads fast whether or not lm-eval is installed).
"""

from __future__ import annotations

from importlib.util import find_spec

__all__ = ["HARNESS_PACKAGES", "require_lm_eval"]

HARNESS_PACKAGES = ("lm_eval", "aiohttp", "tenacity")  # lm-eval's local-* models need the last two


def require_lm_eval(where: str) -> None:
    """Refuse `where` when the harness extra is not installed."""
    missing = [p for p in HARNESS_PACKAGES if find_spec(p) is None]
    if missing:
        raise ValueError(f"{where}: needs lm-eval, not installed (missing {missing}): "
                         "pip install 'pinned-eval[harness]'")
