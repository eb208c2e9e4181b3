"""`python -m bench` with no argument runs every benchmark a plain machine can run; the multi-host
one (root, network namespaces) runs only when named."""

from __future__ import annotations

import pytest

from bench.__main__ import BY_NAME_ONLY, modules, plan


def test_no_argument_runs_every_module_but_the_by_name_ones() -> None:
    assert [name for name, _ in plan([])] == [m for m in modules() if m not in BY_NAME_ONLY]
    assert "multihost" in modules() and {"multihost"} == BY_NAME_ONLY


def test_a_by_name_module_runs_when_named_with_or_without_arguments() -> None:
    assert plan(["multihost"]) == [("multihost", None)]
    assert plan(["multihost", "--points", "4"]) == [("multihost", ["--points", "4"])]


def test_an_unknown_name_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(SystemExit, match=r"no benchmark 'nope'; known: .*multihost"):
        plan(["nope"])


def test_cpu_busy_counts_every_state_but_idle_and_iowait(tmp_path) -> None:
    """The multi-host bench's 'CPU busy' column: /proc/stat's first line, idle (4th) and iowait (5th) excluded."""
    from bench import multihost

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 7 50 1000 30 3 2 1 0 0\ncpu0 50 3 25 500 15 1 1 0 0 0\n")
    assert multihost._cpu_times(stat) == (163, 1193)
