"""Two processes finishing points at once on one JSONL metrics file lose no row and interleave none.

Each point's rows replace the file under an exclusive `flock` on `<file>.lock` (read, rewrite to a
temp file, rename), so two eval-point flow runs of one run writing the same sink file at once
(`pinned_eval.sinks.JsonlSink.write_point`) each see the other's rows. Real processes, released
together; the file is read back line by line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pinned_eval.sinks import JsonlSink

N = 30
_WRITER = """
import sys
from pinned_eval.sinks import JsonlSink, MetricRow
sink = JsonlSink(sys.argv[1])
first, n = int(sys.argv[2]), int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
for step in range(first, first + n):
    sink.write_point([MetricRow(run="exp1", step=step, dataset=d, state="measured", metrics={"eval/x": step + i})
                      for i, d in enumerate(("a", "b"))])
print("done", flush=True)
"""


def test_two_processes_finishing_points_at_once_lose_no_row_and_interleave_none(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("not a row, kept\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(first), str(N)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
             for first in (0, 1000)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:  # go: both write at once
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.close()
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = path.read_bytes().split(b"\n")
    assert lines[0] == b"not a row, kept" and lines[-1] == b""
    rows = [json.loads(line) for line in lines[1:-1]]  # every line one whole row: nothing interleaved
    got = sorted((r["step"], r["dataset"], r["metrics"]["eval/x"]) for r in rows)
    want = sorted((s, d, s + i) for first in (0, 1000) for s in range(first, first + N) for i, d in enumerate("ab"))
    assert got == want  # every row of every point, once
    for first in (0, 1000):  # each process's points in the order it finished them
        assert [r["step"] for r in rows if first <= r["step"] < first + N] == [s for s in range(first, first + N)
                                                                                for _ in "ab"]
    assert len(JsonlSink(path).read()) == 4 * N
