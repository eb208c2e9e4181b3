"""Point gateway overhead: one model call through `PointGateway` against the same call straight to
the router (goal: p50 overhead ≤ 1 ms and ≤ 5 % of the call).

A CPU engine (tiny model) behind the real sglang-router; the gateways in a process of their own,
as a point runs them (user code calls from another process). Variants, interleaved call by call
so they share the load of the moment:
- `/generate`: `input_ids`, `max_new_tokens` N, greedy, `return_logprob` (what miles' generate hub
  sends); `chat`: `/v1/chat/completions`, one user message, `max_tokens` N;
- `direct` (the fleet's key, straight to the router), `via gateway` (`PointGateway` as it is: its
  second hop over its own keep-alive client, `Upstream`), and `via gateway (httpx hop)`
  (`HttpxGateway`: the same gateway as it was before `Upstream`, httptools and the bare ASGI app:
  the second hop through the point's httpx client, uvicorn's h11 parser, Starlette's routing). The gateways add the key,
  check the version, count and record.
`overhead` is per pair (gateway call minus the direct call of the same round): p50, p90, p99, and
the p50 as a percentage of the direct call's p50. `gateway CPU` is the CPU time the gateways'
process spent per call (its process CPU clock read before and after each call, Linux): the
gateway's own work, which a loaded machine stretches in wall time, and less noisy than wall time.

Usage: `python -m bench gateway [--calls N] [--max-new-tokens N]` (defaults 200, 8).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pinned_eval.fleet.cpu_engine import CpuEngineArgs, engine_spec
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.fleet.keys import FleetKeys
from pinned_eval.fleet.launcher import LaunchedFleet, launch_fleet
from pinned_eval.gateway import GatewayLimits, PointGateway
from pinned_eval.rollout.session import PointSession


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NagleGateway(PointGateway):
    """The gateway before the Nagle fix: a listening socket with `proto` 0, so asyncio leaves Nagle on."""

    @staticmethod
    def _listener() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        return sock


class HttpxGateway(PointGateway):
    """The gateway before `Upstream`: its second hop through the point's httpx client, uvicorn's h11
    protocol parsing the requests, Starlette routing them (the same endpoints)."""

    _http = "h11"

    def __init__(self, session: PointSession, limits: GatewayLimits) -> None:
        from starlette.applications import Starlette
        from starlette.routing import Route

        super().__init__(session, limits)
        self._send = None
        self._app = Starlette(routes=[Route(r.path, r.endpoint, methods=sorted(r.methods)) for r in self._routes()])


VARIANTS = ("direct", "via gateway", "via gateway (httpx hop)")


def cpu_clock(pid: int) -> int:
    """The process CPU clock id of `pid` (Linux: `clock_getcpuclockid`, which Python does not expose)."""
    return ((~pid) << 3) | 2  # CPUCLOCK_SCHED, process-wide


async def _serve(router: str, key: str) -> None:
    """The gateways' process: both gateways on one session; their addresses on stdout; until stdin ends."""
    async with httpx.AsyncClient(timeout=60) as http:
        session = PointSession(RouterGenerator(http, router, api_key=key), expected_version="1", rid_prefix="bench")
        async with PointGateway(session, GatewayLimits()) as gw, HttpxGateway(session, GatewayLimits()) as old:
            print(json.dumps({"via gateway": [gw.base_url, gw.token], "via gateway (httpx hop)":
                              [old.base_url, old.token]}), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
            bad = [c for c in [*gw.calls, *old.calls] if c.status != 200]
            assert gw.violation is None and not bad, bad[:3]


def start_fleet(base: Path) -> LaunchedFleet:
    from engine.tiny_model import make_tiny_model

    model = make_tiny_model(base / "m", arch="llama", seed=0, chat_template="chatml")
    keys = FleetKeys.resolve()
    spec = engine_spec(
        CpuEngineArgs(model_path=str(model), port=_free_port(), weight_version="1", api_key=keys.api,
                      admin_api_key=keys.admin),
        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    return launch_fleet([spec], log_dir=base / "logs", keys=keys, ready_timeout_s=180)


async def measure(
    fleet: LaunchedFleet, calls: int, max_new: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    assert fleet.router_url is not None and fleet.keys is not None
    router = fleet.router_url
    bodies: dict[str, tuple[str, dict[str, Any]]] = {
        "/generate": ("/generate", {"input_ids": [1, 5, 6, 7], "return_logprob": True,
                                    "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}),
        "chat": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": max_new, "temperature": 0}),
    }
    times: dict[str, list[float]] = {f"{k} {v}": [] for k in bodies for v in VARIANTS}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    child = subprocess.Popen([sys.executable, "-m", "bench.gateway", "--serve"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdin.write(json.dumps([router, fleet.keys.api]) + "\n")  # the key never on a command line
        child.stdin.flush()
        served = json.loads(await asyncio.to_thread(child.stdout.readline))
        clock = cpu_clock(child.pid)
        targets = {"direct": (router, {"Authorization": f"Bearer {fleet.keys.api}"}),
                   **{v: (url, {"Authorization": f"Bearer {token}"}) for v, (url, token) in served.items()}}
        async with httpx.AsyncClient(timeout=60) as user:
            for i in range(calls + 5):  # the first 5 rounds warm up
                for name, (path, body) in bodies.items():
                    for variant, (url, headers) in targets.items():
                        c0, t0 = time.clock_gettime(clock), time.perf_counter()
                        r = await user.post(url + path, json=body, headers=headers)
                        elapsed, used = time.perf_counter() - t0, time.clock_gettime(clock) - c0
                        assert r.status_code == 200, r.text
                        if i >= 5:
                            times[f"{name} {variant}"].append(elapsed)
                            cpu[f"{name} {variant}"].append(used)
        child.stdin.close()
        assert child.wait(timeout=30) == 0, "the gateways' process failed"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return times, cpu


def table(times: dict[str, list[float]], cpu: dict[str, list[float]]) -> list[str]:
    """One row per call and gateway variant; the overhead is per pair with the direct call of that round."""
    lines = ["| call | gateway | direct p50 ms | via gateway p50 ms | overhead p50 ms | overhead p90 ms "
             "| overhead p99 ms | overhead p50 % | gateway CPU ms p50 | gateway CPU ms mean |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    calls = dict.fromkeys(k.split(" ", 1)[0] for k in times)
    for name in calls:
        direct = times[f"{name} direct"]
        d50 = statistics.median(direct)
        for variant in VARIANTS[1:]:
            via = times.get(f"{name} {variant}")
            if not via:
                continue
            over = [g - d for g, d in zip(via, direct, strict=True)]
            o50 = statistics.median(over)
            used = cpu[f"{name} {variant}"]
            label = "before (httpx hop)" if variant.endswith("(httpx hop)") else "now"
            lines.append(f"| {name} | {label} | {d50 * 1000:.2f} | {statistics.median(via) * 1000:.2f} | "
                         f"{o50 * 1000:.2f} | {_pct(over, 0.90) * 1000:.2f} | {_pct(over, 0.99) * 1000:.2f} | "
                         f"{100 * o50 / d50:.1f} | {statistics.median(used) * 1000:.2f} | "
                         f"{statistics.mean(used) * 1000:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="measured calls per variant (default 200)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens per call (default 8)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the gateways' process
    args = parser.parse_args(argv or [])
    if args.serve:
        router, key = json.loads(sys.stdin.readline())
        asyncio.run(_serve(router, key))
        return
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        fleet = start_fleet(Path(tmp))
        try:
            times, cpu = asyncio.run(measure(fleet, args.calls, args.max_new_tokens))
        finally:
            fleet.stop()
    print(f"{args.calls} calls per variant, max_new_tokens {args.max_new_tokens}, {os.cpu_count()} CPUs, "
          f"load average {load[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print("\n".join(table(times, cpu)))


if __name__ == "__main__":
    main(sys.argv[1:])
