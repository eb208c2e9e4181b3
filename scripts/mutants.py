"""`make mutants`: mutation testing of the invariant modules, one module at a time (docs/testing.md).

Runs `mutmut run "<module>.*"` under `nice` for each module below, smallest first, then prints one
table row per module: mutants, killed (a test failed, or it timed out), survived, no tests (no fast
test calls the mutated function), and the score killed / total. mutmut's own config (which files it
mutates, which fast tests it may run) is `[tool.mutmut]` in pyproject.toml; it records which test
calls which function and runs each mutant against those tests only.

    python scripts/mutants.py                  # every module, then the table
    python scripts/mutants.py spool check      # only these modules (a dotted suffix of a module name)
    python scripts/mutants.py --survivors      # re-run only the mutants that survived last time
    python scripts/mutants.py --report         # the table from the last results, nothing run
    python scripts/mutants.py spool --against tests/fast/test_sec_spool.py   # quick lower bound

`--against FILE...` runs each mutant of the named modules alone (`--children` at a time) against only
those test files (`MUTANT_UNDER_TEST=<name>` in mutants/, after a `mutmut run` generated them): a mutant one of
them fails is killed whatever the other tests say, so its score is a lower bound, and minutes
instead of hours where the full selection starts threads and servers. A run past `--timeout` is
counted under "other", not killed. Its results go to
`mutants/<source>.against.json`, never into mutmut's own; `--match TEXT...` keeps only the mutants
whose name contains one of the texts (a function name, e.g. `_loop`).

Not part of `make test`: a full run takes tens of minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTMUT = Path(sys.executable).parent / "mutmut"

# (module, its source file, the fast tests that cover it), smallest module first; mutmut narrows each
# mutant further to the tests that call the mutated function
_EVAL_CLIENT = ("test_eval_client", "test_sec_spool", "test_sec_staging")
MODULES: list[tuple[str, str, tuple[str, ...]]] = [
    ("pinned_eval.skip_mapping", "pinned_eval/skip_mapping.py", ("test_skip_mapping", "test_mut_skip_mapping")),
    ("pinned_eval.fleet.readback", "pinned_eval/fleet/readback.py", ("test_mut_readback",)),
    # ensure_limit and the slot arguments only act on a real server: the e2e admission tests (one server)
    ("tasks.admission", "tasks/admission.py", ("test_mut_tasks_admission", "../e2e/test_admission")),
    ("pinned_eval.scoring.passk", "pinned_eval/scoring/passk.py", ("test_passk", "test_metrics")),
    (
        "trainer_integration.admission_sync",
        "trainer_integration/admission_sync.py",
        (*_EVAL_CLIENT, "test_mut_admission", "test_mut_admission_thread"),
    ),
    (
        "pinned_eval.snapshot.confined",
        "pinned_eval/snapshot/confined.py",
        ("test_sec_staging", "test_staging_paths", "test_sec_payloads", "test_eval_client", "test_mut_confined",
         "test_sec_whole_paths"),
    ),
    (
        "trainer_integration.admission",
        "trainer_integration/admission.py",
        (*_EVAL_CLIENT, "test_mut_admission", "test_rule_boundaries"),
    ),
    ("pinned_eval.scoring.metrics", "pinned_eval/scoring/metrics.py", ("test_metrics", "test_mut_metrics")),
    (
        "trainer_integration.spool",
        "trainer_integration/spool.py",
        (*_EVAL_CLIENT, "test_mut_spool", "test_spool_guarantees"),
    ),
    (
        "pinned_eval.snapshot.check",
        "pinned_eval/snapshot/check.py",
        ("test_snapshot_check", "test_sec_snapshot_metadata", "test_staging_paths", "test_mut_check",
         "test_sec_snapshot_dtypes"),
    ),
    (
        "pinned_eval.snapshot.staging",
        "pinned_eval/snapshot/staging.py",
        ("test_staging_paths", "test_sec_staging", "test_sec_payloads", "test_eval_client", "test_mut_staging"),
    ),
]


KILLED = {1, 3, 24, -24, 152, 255, 36, 37, -9, -11}  # a failing test, a timeout, a crash
SURVIVED = {0}
NO_TESTS = {5, 33}


def _check_config() -> None:
    """The modules and tests above are exactly what `[tool.mutmut]` mutates and may run."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    sources = {source for _, source, _ in MODULES}
    tests = {os.path.normpath(f"tests/fast/{t}.py") for _, _, ts in MODULES for t in ts}
    if set(conf["only_mutate"]) != sources or set(conf["pytest_add_cli_args_test_selection"]) != tests:
        sys.exit(
            "scripts/mutants.py and [tool.mutmut] disagree: "
            f"sources {sorted(sources ^ set(conf['only_mutate']))}, "
            f"tests {sorted(tests ^ set(conf['pytest_add_cli_args_test_selection']))}"
        )


def _results(source: str) -> dict[str, int | None]:
    meta = ROOT / "mutants" / f"{source}.meta"
    if not meta.exists():
        return {}
    return dict(json.loads(meta.read_text())["exit_code_by_key"])


def _run(names: list[str], children: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutmut puts mutants/ first itself
    t0 = time.monotonic()
    subprocess.run(
        ["nice", "-n", "10", str(MUTMUT), "run", "--max-children", str(children), *names],
        cwd=ROOT,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.monotonic() - t0


def _against(source: str, tests: list[str], timeout_s: float, match: list[str], children: int) -> dict[str, int | None]:
    """Each mutant of `source` alone against `tests` only, `children` at a time; exit code by mutant name."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "mutants")}  # the mutated packages, not the tree's
    for t in tests:  # the tests as they are now, not as the last `mutmut run` copied them
        shutil.copy2(ROOT / t, ROOT / "mutants" / t)
    codes: dict[str, int | None] = {}
    out = ROOT / "mutants" / f"{source}.against.json"
    # constructors last: their mutants are the ones any test kills; the rest first, should a run be cut short
    names = [n for n in _results(source) if not match or any(m in n for m in match)]
    names.sort(key=lambda n: ("__init__" in n, n))

    def one(name: str) -> int | None:
        try:
            return subprocess.run(
                ["nice", "-n", "10", sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                cwd=ROOT / "mutants",
                env={**env, "MUTANT_UNDER_TEST": name},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout_s,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            return None  # not counted as killed: on a loaded machine a slow run is no proof of a hang

    with ThreadPoolExecutor(max_workers=children) as pool:
        for name, rc in zip(names, pool.map(one, names), strict=True):
            codes[name] = rc
            verdict = "timeout" if rc is None else "killed" if rc in KILLED else "survived" if rc in SURVIVED else rc
            print(f"  {name}: {verdict}", flush=True)
            out.write_text(json.dumps({"tests": tests, "codes": codes}))  # after each: a cut-short run keeps its part
    return codes


def _row(module: str, source: str, seconds: float | None, codes: list[int | None] | None = None) -> tuple[str, ...]:
    codes = list(_results(source).values()) if codes is None else codes
    killed = sum(c in KILLED for c in codes)
    survived = sum(c in SURVIVED for c in codes)
    no_tests = sum(c in NO_TESTS for c in codes)
    other = len(codes) - killed - survived - no_tests
    score = f"{100 * killed / len(codes):.1f}%" if codes else "-"
    took = f"{seconds / 60:.1f} min" if seconds is not None else "-"
    return (module, str(len(codes)), str(killed), str(survived), str(no_tests), str(other), score, took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="a dotted suffix of a module name (default: all)")
    parser.add_argument("--survivors", action="store_true", help="re-run only last run's survivors")
    parser.add_argument("--report", action="store_true", help="print the table of the last results only")
    parser.add_argument("--children", type=int, default=2, help="mutants tested in parallel")
    parser.add_argument("--against", nargs="+", metavar="FILE", help="only these test files, one mutant at a time")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant with --against")
    parser.add_argument("--match", nargs="+", metavar="TEXT", help="with --against: only mutants whose name has TEXT")
    args = parser.parse_args()
    _check_config()
    chosen = MODULES
    if args.modules:
        picked = {a: [m for m in MODULES if m[0] == a or m[0].endswith("." + a)] for a in args.modules}
        bad = sorted(a for a, ms in picked.items() if len(ms) != 1)
        if bad:
            parser.error(f"no single module named {bad} (e.g. 'spool', 'tasks.admission')")
        chosen = [m for m in MODULES if any(m in ms for ms in picked.values())]
    took: dict[str, float] = {}
    if args.against:
        rows = []
        for module, source, _tests in chosen:
            t0 = time.monotonic()
            codes = _against(source, args.against, args.timeout, args.match or [], args.children)
            rows.append(_row(module, source, time.monotonic() - t0, list(codes.values())))
        _print_table(rows)
        return
    if not args.report:
        for module, source, _tests in chosen:
            survivors = [k for k, c in _results(source).items() if c in SURVIVED]
            names = survivors if args.survivors else [f"{module}.*"]
            if names:
                print(f"mutants: {module} ({len(names) if args.survivors else 'all'})", flush=True)
                took[module] = _run(names, args.children)
    _print_table([_row(m, s, took.get(m)) for m, s, _ in chosen])


def _print_table(body: list[tuple[str, ...]]) -> None:
    header = ("module", "mutants", "killed", "survived", "no tests", "other", "score", "took")
    rows = [header, *body]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
