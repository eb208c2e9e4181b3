"""The ledger's cost as its file grows: the append-only ledger beside the whole-file rewrite it replaced.

At each size (rows already in the file: 2,000 and 200,000 by default, two datasets a point), two
files hold the same rows: one written as the rewrite scheme left them (unframed rows), one as the
append-only ledger does (`pinned_eval.sinks.Ledger`: framed writes). Then, alternating, timed:

- `write_point`: a new point of 2 rows. Old: the scheme before 2026-12-05, reproduced here
  (`_Rewrite`: every line read and parsed, the file rewritten to a temp file + fsync + rename under
  the lock). New: one append + fsync under the lock.
- `update_point`: a sink-failure note (the log task's and the deliverer's `update_point`) on the
  point just written (`newest`, as they make it) and on a point in the middle of the file. Old:
  the point's rows read, then the whole rewrite. New: the file read backwards to the point's last
  write, the scan from there (other points' lines passed over unparsed), then one append.
- `read(steps=[one])`: the rows of one point (the trainer's `outcomes_of`, `history`).

Each cell is the median of `--reps` calls; `bytes written` is what one call writes (new: the
file's growth; old: the whole new file). The new file grows by each call (dead rows), as in use;
none of these sizes crosses a compaction threshold during the run.

`python -m bench ledger [--rows 2000,200000] [--reps 5]`
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from pinned_eval.durable import replace_durably
from pinned_eval.sinks import Ledger, MetricRow
from pinned_eval.sinks.ledger_file import HEAD, append, locked

DATASETS = ("arith_add", "arith_sub")


def _rows(step: int, value: float = 0.5) -> list[MetricRow]:
    return [MetricRow(run="bench", step=step, dataset=ds, state="measured", weight_version=str(step),
                      metrics={f"eval/{ds}": value, "eval/step": float(step), "eval/lag_steps": 0.0},
                      flow_run_id="5f0c7a1e-2b3d-4c5e-8f90-a1b2c3d4e5f6") for ds in DATASETS]


class _Rewrite:
    """The rewrite scheme as it was: a write reads every line and rewrites the whole file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _lines(self, wanted: Callable[[str, int], bool] | None = None) -> list[tuple[bytes, MetricRow | None]]:
        import json

        out: list[tuple[bytes, MetricRow | None]] = []
        with open(self.path, "rb") as f:
            for raw in f:
                head = HEAD.match(raw) if wanted is not None else None
                if wanted is not None and head is not None and not wanted(json.loads(head[1]), int(head[2])):
                    continue
                try:
                    out.append((raw, MetricRow.model_validate_json(raw)))
                except ValueError:
                    out.append((raw, None))
        return out

    def _rewrite(self, points: set[tuple[str, int]], rows: list[MetricRow]) -> int:
        kept = [raw for raw, row in self._lines() if row is None or (row.run, row.step) not in points]
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.writelines([*kept, *(r.to_line() for r in rows)])
        replace_durably(tmp, self.path)
        return self.path.stat().st_size

    def write_point(self, rows: list[MetricRow]) -> int:
        with locked(self.path):
            return self._rewrite({(r.run, r.step) for r in rows}, rows)

    def update_point(self, run: str, step: int, change: Callable[[list[MetricRow]], list[MetricRow]]) -> int:
        with locked(self.path):
            rows = [r for _, r in self._lines(lambda a, b: (a, b) == (run, step)) if r is not None]
            return self._rewrite({(run, step)}, change(rows))

    def read(self, steps: set[int]) -> list[MetricRow]:
        return [r for _, r in self._lines(lambda a, b: b in steps) if r is not None and r.step in steps]


def _note(rows: list[MetricRow]) -> list[MetricRow]:
    return [r.model_copy(update={"sink_errors": {"mlflow": "bench"}}) for r in rows]


def _timed(fn: Callable[[], object]) -> float:
    return _returned(fn)[0]


def _returned(fn: Callable[[], object]) -> tuple[float, object]:
    t = time.perf_counter()
    got = fn()
    return time.perf_counter() - t, got


def _sized(ledger: Ledger, fn: Callable[[], object]) -> tuple[float, int]:
    before = ledger.path.stat().st_size
    return _timed(fn), ledger.path.stat().st_size - before


def run_size(root: Path, n_rows: int, reps: int) -> list[tuple[str, int, float, float, int, int]]:
    points = n_rows // len(DATASETS)
    old_path, new_path = root / f"old-{n_rows}.jsonl", root / f"new-{n_rows}.jsonl"
    batch = 5000  # points a framed write while seeding (each point's rows in it, distinct points)
    for first in range(0, points, batch):
        rows = [r for step in range(first, min(points, first + batch)) for r in _rows(step)]
        with open(old_path, "ab") as f:
            f.writelines(r.to_line() for r in rows)
        append(new_path, [r.to_line() for r in rows])
    old, new = _Rewrite(old_path), Ledger(new_path)
    middle = points // 2
    cells: dict[str, tuple[list[float], list[float], list[int], list[int]]] = {
        op: ([], [], [], []) for op in ("write_point", "update_point (newest)", "update_point (middle)",
                                        "read(steps=[one])")}
    for i in range(reps):
        _one_rep(old, new, cells, points + i, middle - 1 - i, middle + 1 + i)  # each note on a point untouched
    assert new.read("bench", steps={middle - 1})[0].sink_errors == {"mlflow": "bench"}
    return [(op, n_rows, statistics.median(o), statistics.median(n), int(statistics.median(ob)),
             int(statistics.median(nb))) for op, (o, n, ob, nb) in cells.items()]


def _one_rep(old: _Rewrite, new: Ledger, cells: dict[str, tuple[list[float], list[float], list[int], list[int]]],
             step: int, middle: int, want: int) -> None:
    """One call of each operation, old then new: a new point `step`, a note on it and on `middle`
    (written only when the file was seeded), a read of `want`."""
    for op, call_old, call_new in (
        ("write_point", lambda: old.write_point(_rows(step)), lambda: new.write_point(_rows(step))),
        ("update_point (newest)", lambda: old.update_point("bench", step, _note),
         lambda: new.update_point("bench", step, _note)),
        ("update_point (middle)", lambda: old.update_point("bench", middle, _note),
         lambda: new.update_point("bench", middle, _note)),
    ):
        t, wrote = _returned(call_old)
        cells[op][0].append(t)
        cells[op][2].append(int(cast(int, wrote)))
        t, grew = _sized(new, call_new)
        cells[op][1].append(t)
        cells[op][3].append(grew)
    got_old: list[MetricRow] = []
    got_new: list[MetricRow] = []
    cells["read(steps=[one])"][0].append(_timed(lambda: got_old.extend(old.read({want}))))
    cells["read(steps=[one])"][1].append(_timed(lambda: got_new.extend(new.read("bench", steps={want}))))
    cells["read(steps=[one])"][2].append(0)
    cells["read(steps=[one])"][3].append(0)
    assert [r.key for r in got_old] == [r.key for r in got_new] == [("bench", want, d) for d in DATASETS]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench ledger")
    parser.add_argument("--rows", default="2000,200000", help="rows in the file before timing, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv or [])
    sizes = [int(s) for s in args.rows.split(",")]
    print(f"{'operation':<22} {'rows':>8} {'old (rewrite)':>14} {'new (append)':>13} {'old/new':>8} "
          f"{'old bytes written':>18} {'new bytes written':>18}")
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        for n_rows in sizes:
            for op, n, old_s, new_s, old_b, new_b in run_size(Path(tmp), n_rows, args.reps):
                print(f"{op:<22} {n:>8,} {old_s * 1e3:>11.2f} ms {new_s * 1e3:>10.2f} ms {old_s / new_s:>7.1f}x "
                      f"{old_b:>18,} {new_b:>18,}")


if __name__ == "__main__":
    main()
