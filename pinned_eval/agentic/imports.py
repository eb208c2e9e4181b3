"""Where user code is imported from, and by which interpreter; the suite-load check of it.

Contract:
- `check_import_roots(roots)`: every import root (a dataset's `python_path`, resolved by
  `EvalSuite.import_roots`) must be an existing directory whose whole path is this user's
  (`pinned_eval.trusted_paths.check_trusted`) and which neither its group nor others can write,
  sticky bit or not (in a sticky /tmp a neighbour can still add `json.py`, and a module on the
  import path is code run as the worker's user). A refusal is an `UntrustedPathError` naming the
  root; the roots are returned as given.
- `check_interpreter(path)`: `miles_python` must be an absolute path to an executable regular file
  whose whole path is trusted (same rule), else `UntrustedPathError` naming it.
- `runner_command(python, *args)`: the argv and environment additions that start
  `pinned_eval.agentic.runner` under `python` (None: this interpreter). The working directory is
  never on the runner's import path (`sys.path[0]` is dropped before anything is imported); with
  another interpreter, the directory holding this `pinned_eval` package is put first on its
  `PYTHONPATH` (that environment needs pinned-eval's own dependencies: pydantic, httpx).
- `check_generate_imports(datasets)`: every import path a dataset names for user code
  (`generate_function`, `generate_tool_specs_path`, `generate_execute_tool_function_path`,
  `custom_agent_function_path`) is imported in a throwaway runner subprocess
  (`python -m pinned_eval.agentic.runner --check`, miles-compatible surface installed, the
  datasets' `python_path` roots first on `sys.path`, under their `miles_python`: the same roots
  and interpreter every point uses), never in the calling process. A module that cannot be
  imported, a missing attribute, an import of a miles module outside the surface, or a refused
  root raises `ValueError` naming the dataset, the path and the module.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Sequence

from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.trusted_paths import UntrustedPathError, check_trusted

__all__ = [
    "CHECK_TIMEOUT_S",
    "PACKAGE_ROOT",
    "check_generate_imports",
    "check_import_roots",
    "check_interpreter",
    "runner_command",
    "runner_settings",
    "user_paths",
]

CHECK_TIMEOUT_S = 120.0
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# `python -c` puts the working directory ('') first on sys.path (not under -P / PYTHONSAFEPATH):
# drop it before any import (only the builtin `sys` is imported first), then run the runner
# module as `python -m` would
_BOOT = ("import sys\nif sys.path and sys.path[0] == '': del sys.path[0]\nimport runpy\n"
         "runpy.run_module('pinned_eval.agentic.runner', run_name='__main__', alter_sys=True)")


def user_paths(ds: ResolvedDataset) -> list[str]:
    """The import paths of user code `ds` names (generate function first)."""
    paths = (ds.generate_function, ds.generate_tool_specs_path, ds.generate_execute_tool_function_path,
             ds.custom_agent_function_path)
    return [p for p in paths if p]


def check_import_roots(roots: Sequence[str]) -> list[str]:
    """Refuse an import root another user could add a module to (see the module docstring)."""
    for root in roots:
        try:
            st = os.stat(root)
        except OSError as exc:
            raise UntrustedPathError(f"python_path entry {root!r}: {exc.strerror}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise UntrustedPathError(f"python_path entry {root!r}: not a directory")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UntrustedPathError(
                f"python_path entry {root!r} refused: its group or others can add modules to it "
                f"(mode {stat.S_IMODE(st.st_mode):o}); a module there would run as this user")
        check_trusted(root, "python_path entry")
    return list(roots)


def check_interpreter(path: str) -> str:
    """Refuse a `miles_python` that is not a trusted executable file (see the module docstring)."""
    if not os.path.isabs(path):
        raise UntrustedPathError(f"miles_python {path!r}: give an absolute path to a python interpreter")
    check_trusted(path, "miles_python")
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UntrustedPathError(f"miles_python {path!r}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or not os.access(path, os.X_OK):
        raise UntrustedPathError(f"miles_python {path!r}: not an executable file")
    return path


def runner_settings(datasets: Sequence[ResolvedDataset]) -> tuple[list[str], str | None]:
    """The import roots (in order, each once) and interpreter of `datasets`' runner; datasets
    naming different interpreters are refused (one runner per point)."""
    roots: list[str] = []
    for ds in datasets:
        roots.extend(r for r in ds.python_path if r not in roots)
    pythons = {ds.miles_python for ds in datasets if ds.generate_function is not None}
    if len(pythons) > 1:
        raise ValueError(f"miles_python: one runner per point; datasets set {sorted(pythons, key=str)}")
    return roots, (pythons.pop() if pythons else None)


def runner_command(python: str | None, *args: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment additions) that start the runner (see the module docstring)."""
    if python is None:
        return [sys.executable, "-c", _BOOT, *args], {}
    inherited = os.environ.get("PYTHONPATH")
    return [python, "-c", _BOOT, *args], {"PYTHONPATH": os.pathsep.join(filter(None, [PACKAGE_ROOT, inherited]))}


def check_generate_imports(datasets: Sequence[ResolvedDataset], *, cwd: str | None = None) -> None:
    """Dry-import every dataset's user code (see the module docstring)."""
    owners: dict[str, str] = {}
    for ds in datasets:
        for path in user_paths(ds):
            owners.setdefault(path, ds.name)
    if not owners:
        return
    agentic = [ds for ds in datasets if user_paths(ds)]
    roots, python = runner_settings(agentic)
    try:
        check_import_roots(roots)
        if python is not None:
            check_interpreter(python)
    except UntrustedPathError as exc:
        raise ValueError(f"dataset {agentic[0].name!r}: {exc}") from None
    argv, env = runner_command(python, "--check", *owners, *(a for r in roots for a in ("--python-path", r)))
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=CHECK_TIMEOUT_S, cwd=cwd, stdin=subprocess.DEVNULL, check=False,
            env={**os.environ, **env},
        )
    except subprocess.TimeoutExpired as exc:
        raise ValueError(f"generate functions: importing {sorted(owners)} took over {CHECK_TIMEOUT_S:g} s") from exc
    except OSError as exc:
        raise ValueError(f"miles_python {python!r}: cannot run it ({exc.strerror})") from None
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        under = f" under miles_python {python!r}" if python else ""
        raise ValueError(f"generate functions: the import check failed{under} ({tail[0][:300]})") from None
    if not answer.get("ok"):
        path = answer["path"]
        raise ValueError(f"dataset {owners[path]!r}: {path!r}: {answer['message']}")
