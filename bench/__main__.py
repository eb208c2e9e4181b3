"""`python -m bench`: run every benchmark module `bench/<name>.py` that defines `main()`.

`python -m bench NAME ...` runs only the named ones. Each module prints its own table.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def modules() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_"))


def main(argv: list[str]) -> None:
    names = argv or modules()
    for name in names:
        mod = importlib.import_module(f"bench.{name}")
        if hasattr(mod, "main"):
            print(f"\n== bench.{name}")
            mod.main()


if __name__ == "__main__":
    main(sys.argv[1:])
