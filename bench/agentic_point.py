"""An agentic point's orchestration cost against a single-turn point's, on the same CPU engines.

2 CPU engines (tiny model) behind the real sglang-router. The same prompts, the same sampling
(greedy, `max_new_tokens` N), one model call per sample, generated two ways through
`run_rollouts`, as a point's generate task does:
- `single_turn`: the plain rollout (one `/generate` per sample through the point's session);
- `function`: the `function` rollout with miles' generate hub `single_turn` (the point's gateway,
  the runner subprocess, the compat surface; one `/generate` per sample through the gateway), or
  with `--function agent` the hub `agentic_tool_call` over `bench/agentic_agent.py` (one chat
  completion per sample to its gateway session; no tokenizer read in the runner).
The model's work is the same, so the difference is the agentic path's orchestration: the
gateway's and the runner's start (`open`, until `run_rollouts` reports the start) and, per
sample, the round trip through the runner and the gateway (the rest, the runner's first use of
the tokenizer and its stop included). Points alternate (single, function, single, ...) so they
share the load of the moment; the first pair warms up.

The function points are also split into phases (gateway and runner start, the runner's first
sample answered, the other samples, the runner's and the gateway's stop), from timestamps taken
around `PointGateway`'s and `AgentRunner`'s methods.

Usage: `python -m bench agentic_point [--points N] [--samples N] [--max-new-tokens N]
[--function hub|agent]` (defaults 5, 16, 8, hub).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.fleet.cpu_engine import CpuEngineArgs, engine_spec
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.fleet.keys import FleetKeys
from pinned_eval.fleet.launcher import LaunchedFleet, launch_fleet
from pinned_eval.rollout import PointSession, run_rollouts
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults

HUB = "miles.rollout.generate_hub.single_turn.generate"
AGENT_HUB = "miles.rollout.generate_hub.agentic_tool_call.generate"
FUNCTION_LABEL = {"hub": "function (hub single_turn)", "agent": "function (agent function)"}
EAGER = "agentic_agent.generate_reading_tokenizer"
PHASES = ("start", "first sample", "other samples", "stop")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_fleet(base: Path) -> tuple[LaunchedFleet, Path]:
    from engine.tiny_model import make_tiny_model

    model = make_tiny_model(base / "m", arch="llama", seed=0, chat_template="chatml")
    keys = FleetKeys.resolve()
    specs = [engine_spec(CpuEngineArgs(model_path=str(model), port=_free_port(), weight_version="1",
                                       api_key=keys.api, admin_api_key=keys.admin),
                         env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}) for _ in range(2)]
    return launch_fleet(specs, log_dir=base / "logs", keys=keys, ready_timeout_s=180), model


class PhaseClock:
    """Timestamps around the gateway's and the runner's methods (the function rollout's phases)."""

    def __init__(self) -> None:
        self.marks: dict[str, list[float]] = {}

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, []).append(time.perf_counter())

    def install(self) -> None:
        from pinned_eval.agentic.client import AgentRunner
        from pinned_eval.gateway import PointGateway

        clock = self
        enter, generate, close = AgentRunner.__aenter__, AgentRunner.generate, AgentRunner.close
        gw_exit = PointGateway.__aexit__

        async def timed_enter(self: AgentRunner) -> AgentRunner:
            out = await enter(self)
            clock.mark("runner ready")
            return out

        async def timed_generate(self: AgentRunner, request: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
            out = await generate(self, request, timeout_s)
            clock.mark("sample answered")
            return out

        async def timed_close(self: AgentRunner) -> None:
            clock.mark("runner stop")
            await close(self)

        async def timed_gw_exit(self: PointGateway, *exc: object) -> None:
            clock.mark("gateway stop")
            await gw_exit(self, *exc)

        AgentRunner.__aenter__ = timed_enter  # type: ignore[method-assign]
        AgentRunner.generate = timed_generate  # type: ignore[method-assign]
        AgentRunner.close = timed_close  # type: ignore[method-assign]
        PointGateway.__aexit__ = timed_gw_exit  # type: ignore[method-assign]

    def phases(self, t0: float, t1: float) -> dict[str, float]:
        m = self.marks
        ready, answered = m["runner ready"][0], sorted(m["sample answered"])
        stop = m["runner stop"][0]
        return {"start": ready - t0, "first sample": answered[0] - ready, "other samples": answered[-1] - answered[0],
                "stop": t1 - stop}


async def measure(fleet: LaunchedFleet, model: Path, points: int, samples: int, max_new: int,
                  function: str = "hub") -> dict[str, list[float]]:
    assert fleet.router_url is not None and fleet.keys is not None
    defaults = SamplingDefaults(temperature=0.0, max_new_tokens=max_new, reward="exact_match")
    agentic_fields: dict[str, Any] = ({"generate_function": HUB} if function == "hub" else
                      {"generate_function": AGENT_HUB, "custom_agent_function_path": "agentic_agent.run_agent",
                       "python_path": (str(Path(__file__).parent),)})
    suite = EvalSuite(datasets=(DatasetSpec(name="plain", path="/p.jsonl"),
                                DatasetSpec(name="agentic", path="/a.jsonl", **agentic_fields),
                                DatasetSpec(name="eager", path="/e.jsonl", **{
                                    **agentic_fields, "generate_function": EAGER})),
                      defaults=defaults)
    plain, agentic, eager = suite.resolved()
    kinds = [("single_turn", plain), ("function", agentic)]
    if function == "agent":
        kinds.append(("function eager", eager))
    rows = [EvalSample(i, f"{i} + {i} =", str(2 * i)) for i in range(samples)]
    times: dict[str, list[float]] = {k: [] for kind, _ in kinds for k in (kind, f"{kind} open")}
    times.update({phase: [] for phase in PHASES})
    clock = PhaseClock()
    clock.install()
    async with httpx.AsyncClient(timeout=120) as http:
        gen = RouterGenerator(http, fleet.router_url, api_key=fleet.keys.api)
        for p in range(points + 1):  # the first pair warms up
            for kind, ds in kinds:
                session = PointSession(gen, expected_version="1", rid_prefix=f"b{p}{kind}", tokenizer_dir=str(model))
                opened: list[float] = []
                clock.marks.clear()
                t0 = time.perf_counter()
                out = await run_rollouts(session, [ds], {ds.name: rows},
                                         on_start=lambda _n, o=opened: o.append(time.perf_counter()))
                elapsed = time.perf_counter() - t0
                assert len(out) == samples and all(s.weight_version == "1" for s in out), kind
                if p:
                    times[kind].append(elapsed)
                    times[f"{kind} open"].append(opened[0] - t0)
                    if kind == "function":
                        for phase, seconds in clock.phases(t0, t0 + elapsed).items():
                            times[phase].append(seconds)
    return times


def table(times: dict[str, list[float]], function: str = "hub") -> list[str]:
    p50 = {k: statistics.median(v) for k, v in times.items()}
    lines = ["| rollout | generation p50 s | open (gateway + runner start) p50 s | samples + stop p50 s |",
             "|---|---|---|---|"]
    for kind, label in (("single_turn", "single_turn"), ("function", FUNCTION_LABEL[function])):
        lines.append(f"| {label} | {p50[kind]:.3f} | {p50[kind + ' open']:.3f} | "
                     f"{p50[kind] - p50[kind + ' open']:.3f} |")
    d, do = p50["function"] - p50["single_turn"], p50["function open"] - p50["single_turn open"]
    lines.append(f"| orchestration cost (function - single_turn) | {d:.3f} | {do:.3f} | {d - do:.3f} |")
    if "function eager" in p50:
        lines.append(f"| function reading the tokenizer first (the eager load) | {p50['function eager']:.3f} | "
                     f"{p50['function eager open']:.3f} | {p50['function eager'] - p50['function eager open']:.3f} |")
        ratio = p50["function"] / p50["function eager"]
        lines.append(f"| ratio function / function reading the tokenizer | {ratio:.2f} | | |")
    lines += ["", "| function point phase | p50 s | share of the function point's p50 |", "|---|---|---|"]
    lines += [f"| {phase} | {p50[phase]:.3f} | {p50[phase] / p50['function']:.2f} |" for phase in PHASES]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench agentic_point", description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=5, help="measured points per rollout (default 5)")
    parser.add_argument("--samples", type=int, default=16, help="samples per point (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens per call (default 8)")
    parser.add_argument("--function", choices=("hub", "agent"), default="hub",
                        help="hub single_turn (default) or an agent function over chat completions")
    args = parser.parse_args(argv or [])
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-agentic-") as tmp:
        fleet, model = start_fleet(Path(tmp))
        try:
            times = asyncio.run(measure(fleet, model, args.points, args.samples, args.max_new_tokens, args.function))
        finally:
            fleet.stop()
    print(f"--function {args.function}: {args.points} points per rollout, {args.samples} samples each, "
          f"max_new_tokens {args.max_new_tokens}, "
          f"2 CPU engines, {os.cpu_count()} CPUs, load average {load[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print("\n".join(table(times, args.function)))
