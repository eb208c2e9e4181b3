"""`python -m bench gateway`: registered, and its table computes the paired overhead exactly."""

from __future__ import annotations

from bench.__main__ import modules, plan
from bench.gateway import table


def test_registered_with_python_m_bench() -> None:
    assert "gateway" in modules() and plan(["gateway", "--calls", "3"]) == [("gateway", ["--calls", "3"])]


def test_overhead_is_per_pair_and_relative_to_the_direct_p50() -> None:
    times = {"chat direct": [0.010, 0.020, 0.030], "chat via gateway": [0.011, 0.022, 0.033]}
    cpu = {"chat direct": [0.001] * 3, "chat via gateway": [0.002] * 3}
    row = table(times, cpu)[2]
    assert row == "| chat | 20.00 | 22.00 | 2.00 | 3.00 | 10.0 | 1.00 | 2.00 |"
