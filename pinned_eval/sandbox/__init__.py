"""Sandboxes for model-written code: safe by default (`bwrap`), unsafe only when chosen.

- `create_sandbox(name)`: the registry. `bwrap` (default) runs code in bubblewrap namespaces under
  rlimits as an unprivileged uid (`pinned_eval.sandbox.bwrap`); `unsafe_subprocess` has the same
  limits but no isolation and is refused unless `allow_unsafe=True`; its results say `unsafe`.
- `Sandbox.run(code | argv, files=, stdin=, limits=) -> RunResult`: bounded stdout/stderr, the exit
  code and a typed `Outcome` (ok, error, timeout, cpu, memory, output_limit, killed, start_failed).
- `pinned_eval.sandbox.python_tool`: a Python tool in miles' retool contract (`tool_specs`,
  `async execute_tool(name, params) -> str`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pinned_eval.sandbox.base import (
    Outcome,
    RunResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
)
from pinned_eval.sandbox.bwrap import BwrapOptions, BwrapSandbox
from pinned_eval.sandbox.unsafe import UnsafeOptions, UnsafeSubprocessSandbox

BACKENDS = ("bwrap", "unsafe_subprocess")
DEFAULT_BACKEND = "bwrap"

__all__ = [
    "BACKENDS", "DEFAULT_BACKEND", "BwrapOptions", "BwrapSandbox", "Outcome", "RunResult", "Sandbox", "SandboxError",
    "SandboxLimits", "SandboxUnavailable", "UnsafeOptions", "UnsafeSubprocessSandbox", "create_sandbox",
]


def create_sandbox(
    name: str = DEFAULT_BACKEND, *, allow_unsafe: bool = False, options: dict[str, Any] | None = None
) -> Sandbox:
    """The backend `name` with `options` (its options model's fields). `SandboxError` naming the
    known backends for an unknown one; `unsafe_subprocess` only with `allow_unsafe=True`;
    `SandboxUnavailable` naming what to install when bwrap (or the sandbox user) is missing."""
    try:
        if name == "bwrap":
            return BwrapSandbox(BwrapOptions(**(options or {})))
        if name == "unsafe_subprocess":
            return UnsafeSubprocessSandbox(UnsafeOptions(**(options or {})), allow_unsafe=allow_unsafe)
    except ValueError as exc:  # pydantic: name the field
        first = exc.errors()[0] if isinstance(exc, ValidationError) else None
        if first is None:
            raise
        where = ".".join(str(p) for p in first["loc"])
        raise SandboxError(f"sandbox {name} options: {where}: {first['msg'].removeprefix('Value error, ')}") from None
    raise SandboxError(f"sandbox: unknown backend {name!r}; known: {', '.join(BACKENDS)}")
