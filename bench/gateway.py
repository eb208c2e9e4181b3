"""Point gateway overhead: one model call through `PointGateway` against the same call straight to
the router (goal: p50 overhead ≤ 1 ms and ≤ 5 % of the call).

A CPU engine (tiny model) behind the real sglang-router; a gateway in front of it, as a point runs
it. Variants, interleaved call by call so they share the load of the moment:
- `/generate direct` / `/generate via gateway`: `input_ids`, `max_new_tokens` N, greedy,
  `return_logprob` (what miles' generate hub sends);
- `chat direct` / `chat via gateway`: `/v1/chat/completions`, one user message, `max_tokens` N.
The direct call carries the fleet's key; the gateway call the gateway's token, and the gateway
adds the key, checks the version, counts and records. A third variant, `via gateway (Nagle)`, is
the gateway as it was before its listening socket named `IPPROTO_TCP` (asyncio then leaves Nagle
on, and each reply's body waits for the client's delayed ACK): old and new side by side. The
client and the gateway share one event loop (the worker runs user code in another process: this
is the pessimistic case). `overhead` is per pair (gateway call minus the direct call next to it):
p50, p90, p99, and the p50 as a percentage of the direct call's p50. `CPU` is this process's CPU
time per call (client, plus the gateway for the gateway calls; the router and engine run
elsewhere): its difference is the gateway's own work, which a loaded machine stretches in wall
time.

Usage: `python -m bench gateway [--calls N] [--max-new-tokens N]` (defaults 200, 8).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
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
    """The gateway before the fix: a listening socket with `proto` 0, so asyncio leaves Nagle on."""

    @staticmethod
    def _listener() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        return sock


VARIANTS = ("direct", "via gateway", "via gateway (Nagle)")


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
    async with httpx.AsyncClient(timeout=60) as http, httpx.AsyncClient(timeout=60) as user:
        session = PointSession(RouterGenerator(http, router, api_key=fleet.keys.api), expected_version="1",
                               rid_prefix="bench")
        async with PointGateway(session, GatewayLimits()) as gw, NagleGateway(session, GatewayLimits()) as old:
            targets = {"direct": (router, {"Authorization": f"Bearer {fleet.keys.api}"}),
                       "via gateway": (gw.base_url, {"Authorization": f"Bearer {gw.token}"}),
                       "via gateway (Nagle)": (old.base_url, {"Authorization": f"Bearer {old.token}"})}
            for i in range(calls + 5):  # the first 5 rounds warm up
                for name, (path, body) in bodies.items():
                    for variant, (url, headers) in targets.items():
                        c0, t0 = time.process_time(), time.perf_counter()
                        r = await user.post(url + path, json=body, headers=headers)
                        elapsed, used = time.perf_counter() - t0, time.process_time() - c0
                        assert r.status_code == 200, r.text
                        if i >= 5:
                            times[f"{name} {variant}"].append(elapsed)
                            cpu[f"{name} {variant}"].append(used)
            assert gw.violation is None and all(c.status == 200 for c in [*gw.calls, *old.calls])
    return times, cpu


def table(times: dict[str, list[float]], cpu: dict[str, list[float]]) -> list[str]:
    """One row per call and gateway variant; the overhead is per pair with the direct call of that round."""
    lines = ["| call | gateway | direct p50 ms | via gateway p50 ms | overhead p50 ms | overhead p90 ms "
             "| overhead p99 ms | overhead p50 % | CPU direct ms (mean) | CPU via gateway ms (mean) |",
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
            label = "before (Nagle on)" if variant.endswith("(Nagle)") else "now"
            lines.append(f"| {name} | {label} | {d50 * 1000:.2f} | {statistics.median(via) * 1000:.2f} | "
                         f"{o50 * 1000:.2f} | {_pct(over, 0.90) * 1000:.2f} | {_pct(over, 0.99) * 1000:.2f} | "
                         f"{100 * o50 / d50:.1f} | {statistics.mean(cpu[f'{name} direct']) * 1000:.2f} | "
                         f"{statistics.mean(cpu[f'{name} {variant}']) * 1000:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="measured calls per variant (default 200)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens per call (default 8)")
    args = parser.parse_args(argv or [])
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
