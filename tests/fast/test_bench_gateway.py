"""`python -m bench gateway`: registered, and its table computes the paired overhead exactly."""

from __future__ import annotations

from bench.__main__ import modules, plan
from bench.gateway import table


def test_registered_with_python_m_bench() -> None:
    assert "gateway" in modules() and plan(["gateway", "--calls", "3"]) == [("gateway", ["--calls", "3"])]


def test_overhead_is_per_pair_and_relative_to_the_direct_p50() -> None:
    times = {"chat direct": [0.010, 0.020, 0.030], "chat via gateway": [0.011, 0.022, 0.033],
             "chat via gateway (httpx hop)": [0.050, 0.060, 0.090]}
    cpu = {"chat direct": [0.0] * 3, "chat via gateway": [0.001, 0.002, 0.006],
           "chat via gateway (httpx hop)": [0.004] * 3}
    rows = table(times, cpu)[2:]
    assert rows == ["| chat | now | 20.00 | 22.00 | 2.00 | 3.00 | 3.00 | 10.0 | 2.00 | 3.00 |",
                    "| chat | before (httpx hop) | 20.00 | 60.00 | 40.00 | 60.00 | 60.00 | 200.0 | 4.00 | 4.00 |"]


def test_the_before_variant_is_the_gateway_with_nagle_on() -> None:
    import socket

    from bench.gateway import NagleGateway
    from pinned_eval.gateway import PointGateway

    with NagleGateway._listener() as old, PointGateway._listener() as new:
        assert (old.proto, new.proto) == (0, socket.IPPROTO_TCP)
        assert old.getsockname()[0] == new.getsockname()[0] == "127.0.0.1"


async def test_the_before_variant_sends_the_second_hop_over_httpx() -> None:
    import httpx

    from bench.gateway import HttpxGateway
    from pinned_eval.fleet.generate import RouterGenerator
    from pinned_eval.gateway import GatewayLimits, PointGateway
    from pinned_eval.rollout.session import PointSession

    async with httpx.AsyncClient() as http:
        session = PointSession(RouterGenerator(http, "http://127.0.0.1:9"), expected_version="1", rid_prefix="b")
        new, old = PointGateway(session, GatewayLimits()), HttpxGateway(session, GatewayLimits())
        assert (old._send, new._send) == (None, new._upstream.send)
        assert (old._http, new._http) == ("h11", "httptools")
        assert (type(old._app).__name__, type(new._app).__name__) == ("Starlette", "App")


def test_the_cpu_clock_is_the_process_clock_of_that_pid() -> None:
    import os
    import time

    from bench.gateway import cpu_clock

    clock = cpu_clock(os.getpid())  # this process's CPU clock, read as another process would read it
    a = time.process_time()
    b = time.clock_gettime(clock)
    sum(i * i for i in range(200_000))  # some CPU work of this process
    c = time.process_time()
    assert a <= b <= c and time.clock_gettime(clock) > b
