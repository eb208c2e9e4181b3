"""Suite-load check of generate functions: `check_generate_imports(datasets, cwd=None)`.

Every import path a dataset names for user code (`generate_function`, `generate_tool_specs_path`,
`generate_execute_tool_function_path`, `custom_agent_function_path`) is imported in a throwaway runner subprocess
(`python -m pinned_eval.agentic.runner --check`, miles-compatible surface installed), never in the
calling process. A module that cannot be imported, a missing attribute, or an import of a miles
module outside the surface raises `ValueError` naming the dataset, the path and the module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

from pinned_eval.datasets.spec import ResolvedDataset

__all__ = ["CHECK_TIMEOUT_S", "check_generate_imports", "user_paths"]

CHECK_TIMEOUT_S = 120.0


def user_paths(ds: ResolvedDataset) -> list[str]:
    """The import paths of user code `ds` names (generate function first)."""
    paths = (ds.generate_function, ds.generate_tool_specs_path, ds.generate_execute_tool_function_path,
             ds.custom_agent_function_path)
    return [p for p in paths if p]


def check_generate_imports(datasets: Sequence[ResolvedDataset], *, cwd: str | None = None) -> None:
    """Dry-import every dataset's user code (see the module docstring)."""
    owners: dict[str, str] = {}
    for ds in datasets:
        for path in user_paths(ds):
            owners.setdefault(path, ds.name)
    if not owners:
        return
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pinned_eval.agentic.runner", "--check", *owners],
            capture_output=True, timeout=CHECK_TIMEOUT_S, cwd=cwd, stdin=subprocess.DEVNULL, check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ValueError(f"generate functions: importing {sorted(owners)} took over {CHECK_TIMEOUT_S:g} s") from exc
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"generate functions: the import check failed ({tail[0][:300]})") from None
    if not answer.get("ok"):
        path = answer["path"]
        raise ValueError(f"dataset {owners[path]!r}: {path!r}: {answer['message']}")
