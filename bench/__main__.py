"""`python -m bench`: run the benchmark modules `bench/<name>.py` that define `main()`.

Usage:
- `python -m bench`: every module except those in `BY_NAME_ONLY`, each with its defaults;
- `python -m bench NAME [NAME...]`: only the named ones, each with its defaults;
- `python -m bench NAME ARGS...`: one module, its `main` given `ARGS` (as soon as an argument is
  not a module name, everything after `NAME` is that module's), e.g.
  `python -m bench orchestration --points 3` or `python -m bench snapshot_io --help`.

A module's `main(argv)` parses its own arguments; for a `main()` that takes none, `--help` prints
the module's docstring and any other argument is an error. Each module prints its own table. An
unknown name is an error that names the known ones.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path

_HELP = (["-h"], ["--help"])
BY_NAME_ONLY = {"multihost"}  # needs root and network namespaces: `python -m bench multihost`


def modules() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_"))


def plan(argv: list[str]) -> list[tuple[str, list[str] | None]]:
    """(module, its arguments or None for its defaults) to run, in order; `SystemExit` on an unknown name."""
    known = modules()
    if not argv:
        return [(name, None) for name in known if name not in BY_NAME_ONLY]
    if argv[0] not in known:
        raise SystemExit(f"python -m bench: no benchmark {argv[0]!r}; known: {', '.join(known)}")
    if all(arg in known for arg in argv):
        return [(name, None) for name in argv]
    return [(argv[0], argv[1:])]


def takes_args(func: Callable[..., object]) -> bool:
    return bool(inspect.signature(func).parameters)


def main(argv: list[str]) -> None:
    if argv[:1] in _HELP:
        print(__doc__)
        print(f"Benchmarks: {', '.join(modules())}")
        return
    for name, args in plan(argv):
        mod = importlib.import_module(f"bench.{name}")
        if not hasattr(mod, "main"):
            continue
        if args is not None and not takes_args(mod.main):
            if args in _HELP:
                print(mod.__doc__)
                return
            raise SystemExit(f"python -m bench {name}: takes no arguments, got {' '.join(args)}")
        print(f"\n== bench.{name}")
        if args is None:
            mod.main()
        else:
            mod.main(args)


if __name__ == "__main__":
    main(sys.argv[1:])
