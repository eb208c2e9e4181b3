"""Sandbox start: one trivial run in the bwrap sandbox against a plain subprocess (goal: p50 ≤ 50 ms).

Variants, interleaved round by round so they share the load of the moment:
- `plain subprocess, print`: `subprocess.run([python3, -s, -c, print(1)])`, what miles' retool
  example does per tool call (no isolation, no limits);
- `unsafe_subprocess, print`: the unsafe backend (rlimits via prlimit, uid drop when root, the
  bounded collector), `run("print(1)")`;
- `bwrap, print`: the default backend, `run("print(1)")`: the whole tool-call cost of a trivial
  snippet;
- `plain subprocess, true` / `bwrap, true`: `/usr/bin/true`, so the difference is the sandbox's
  own start (namespaces, mounts, rlimits, collection) without Python's start-up.
Figures are wall time per call, in ms; `overhead` is the p50 minus the plain variant's p50.

Usage: `python -m bench sandbox_start [--runs N]` (default 60 per variant). Needs bwrap (and, as
root, the `pe-sandbox` user; scripts/ci-services.sh sets both up).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable

from pinned_eval.sandbox import Outcome, SandboxUnavailable, create_sandbox

PYTHON = "/usr/bin/python3"


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _plain(argv: list[str]) -> Callable[[], None]:
    def run() -> None:
        done = subprocess.run(argv, capture_output=True, check=False)
        assert done.returncode == 0, done.stderr

    return run


def variants() -> dict[str, Callable[[], None]]:
    bwrap = create_sandbox("bwrap")
    unsafe = create_sandbox("unsafe_subprocess", allow_unsafe=True)

    def sandboxed(sandbox: object, **kw: object) -> Callable[[], None]:
        def run() -> None:
            result = sandbox.run(**kw)  # type: ignore[attr-defined]
            assert result.outcome is Outcome.OK, result

        return run

    return {
        "plain subprocess, print": _plain([PYTHON, "-s", "-c", "print(1)"]),
        "unsafe_subprocess, print": sandboxed(unsafe, code="print(1)"),
        "bwrap, print": sandboxed(bwrap, code="print(1)"),
        "plain subprocess, true": _plain(["/usr/bin/true"]),
        "bwrap, true": sandboxed(bwrap, argv=["/usr/bin/true"]),
    }


def measure(runs: int) -> dict[str, list[float]]:
    funcs = variants()
    for fn in funcs.values():  # warm the page cache and the imports
        fn()
    times: dict[str, list[float]] = {name: [] for name in funcs}
    for _ in range(runs):
        for name, fn in funcs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def table(times: dict[str, list[float]]) -> list[str]:
    base = {"print": statistics.median(times["plain subprocess, print"]),
            "true": statistics.median(times["plain subprocess, true"])}
    lines = ["| variant | p50 ms | p99 ms | overhead p50 ms |", "|---|---|---|---|"]
    for name, values in times.items():
        p50 = statistics.median(values)
        over = "" if name.startswith("plain") else f"{(p50 - base[name.rsplit(', ', 1)[1]]) * 1000:.1f}"
        lines.append(f"| {name} | {p50 * 1000:.1f} | {_pct(values, 0.99) * 1000:.1f} | {over} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench sandbox_start", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60, help="runs per variant (default 60)")
    args = parser.parse_args(argv or [])
    load = os.getloadavg()
    try:
        times = measure(args.runs)
    except SandboxUnavailable as exc:  # `python -m bench` on a machine without bubblewrap
        print(f"skipped: {exc}")
        return
    print(f"{args.runs} runs per variant, {os.cpu_count()} CPUs, load average {load[0]:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end")
    print("\n".join(table(times)))
