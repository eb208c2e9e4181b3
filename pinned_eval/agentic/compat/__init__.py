"""The miles import surface pinned-eval serves when real miles is not importable.

Contract:
- `SURFACE`: miles module name -> the module of this package that serves it (None: an empty
  package). Served: `miles.utils.types` (`Sample`, its `Status`), `miles.rollout.base_types`
  (`GenerateFnInput`, `GenerateFnOutput`), `miles.utils.http_utils` (`post`, `init_http_client`),
  `miles.utils.misc` (`load_function`), `miles.rollout.sglang_rollout` (`GenerateState`),
  `miles.rollout.generate_utils.generate_endpoint_utils`, `miles.rollout.generate_hub.single_turn`
  (`generate`), `miles.rollout.generate_hub.agentic_tool_call` (`generate`,
  agent functions), `multi_turn` (`generate`, with `generate_utils.tool_call_utils`),
  `miles.rollout.rm_hub` (`async_rm`, `batched_async_rm`: pinned-eval's rewards).
- `install()` puts a meta-path finder first on `sys.meta_path` unless real miles is importable
  (then real miles is used and nothing is installed); it returns whether it installed. It is
  called only inside the runner subprocess (`pinned_eval.agentic.runner`), never in a worker.
- any other `miles.*` import raises `ImportError` naming the module and listing `SURFACE`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types as _types  # not `types`: the submodule `compat.types` rebinds that name here
from collections.abc import Sequence

__all__ = ["SURFACE", "MilesSurfaceFinder", "install", "miles_installed"]

_HERE = __name__
SURFACE: dict[str, str | None] = {
    "miles": None,
    "miles.utils": None,
    "miles.utils.types": f"{_HERE}.types",
    "miles.utils.http_utils": f"{_HERE}.http_utils",
    "miles.utils.misc": f"{_HERE}.misc",
    "miles.rollout": None,
    "miles.rollout.base_types": f"{_HERE}.base_types",
    "miles.rollout.sglang_rollout": f"{_HERE}.sglang_rollout",
    "miles.rollout.generate_utils": None,
    "miles.rollout.generate_utils.generate_endpoint_utils": f"{_HERE}.endpoint",
    "miles.rollout.generate_hub": None,
    "miles.rollout.generate_hub.single_turn": f"{_HERE}.single_turn",
    "miles.rollout.generate_hub.agentic_tool_call": f"{_HERE}.agentic_tool_call",
    "miles.rollout.generate_hub.multi_turn": f"{_HERE}.multi_turn",
    "miles.rollout.generate_utils.tool_call_utils": f"{_HERE}.tool_call_utils",
    "miles.rollout.rm_hub": f"{_HERE}.rm_hub",
}


def surface_error(fullname: str) -> ImportError:
    """The refusal of a miles module outside `SURFACE` (names it, lists the surface)."""
    served = ", ".join(k for k, v in SURFACE.items() if v is not None)
    return ImportError(
        f"miles module {fullname!r} is not in pinned-eval's miles-compatible surface ({served}); "
        "install miles itself to use it",
        name=fullname,
    )


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str | None) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> _types.ModuleType:
        if self.target is None:
            module = _types.ModuleType(spec.name, "pinned-eval's miles-compatible surface (a package)")
            module.__path__ = []
            return module
        return importlib.import_module(self.target)

    def exec_module(self, module: _types.ModuleType) -> None:
        return None


class MilesSurfaceFinder(importlib.abc.MetaPathFinder):
    """Serves `SURFACE`; refuses every other `miles.*` module (see the module docstring)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: _types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "miles" and not fullname.startswith("miles."):
            return None
        if fullname not in SURFACE:
            raise surface_error(fullname)
        target_name = SURFACE[fullname]
        return importlib.machinery.ModuleSpec(fullname, _Loader(target_name), is_package=target_name is None)


def miles_installed() -> bool:
    """Whether real miles is importable (and no compat finder is installed)."""
    if any(isinstance(f, MilesSurfaceFinder) for f in sys.meta_path):
        return False
    try:
        return importlib.util.find_spec("miles") is not None
    except (ImportError, ValueError):
        return False


def install() -> bool:
    """Install the finder unless real miles is importable; True when installed."""
    if any(isinstance(f, MilesSurfaceFinder) for f in sys.meta_path):
        return True
    if miles_installed():
        return False
    sys.meta_path.insert(0, MilesSurfaceFinder())
    return True
