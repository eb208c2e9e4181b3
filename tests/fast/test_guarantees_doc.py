"""docs/guarantees.md: every row names at least one test, and every test it names exists.

A row of a table there is a claim; its test column must give a pytest node id
(`tests/<file>.py::<test>`, or `::<test>` for another test of the file named just before it), and
each named function must be defined in that file (read with `ast`, nothing imported or run).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "guarantees.md"
_NODE = re.compile(r"`(tests/[\w/]+\.py)?::(\w+)`")


@cache
def _defined(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


def _rows() -> list[tuple[int, list[str]]]:
    rows = []
    for lineno, line in enumerate(DOC.read_text(encoding="utf-8").splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 2 and cells[0] not in ("claim (where)",) and not set(cells[0]) <= set("-: "):
            rows.append((lineno, cells))
    return rows


def test_every_row_of_the_guarantees_names_a_test_that_exists() -> None:
    rows = _rows()
    assert len(rows) >= 47, f"only {len(rows)} rows read from {DOC}"
    problems = []
    for lineno, cells in rows:
        named = _NODE.findall(cells[1])
        if not named:
            problems.append(f"docs/guarantees.md:{lineno}: no test named in {cells[1]!r:.80}")
        current = None
        for path, name in _NODE.findall(" ".join(cells)):
            current = path or current
            if current is None or not (ROOT / current).is_file():
                problems.append(f"docs/guarantees.md:{lineno}: no file for ::{name}")
            elif name not in _defined(current):
                problems.append(f"docs/guarantees.md:{lineno}: {current} defines no {name}")
    assert not problems, "\n".join(problems)
