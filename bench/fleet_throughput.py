"""Generation throughput through the fleet client (via sglang-router) vs a plain httpx client.

Same run, same two CPU engines, same prompts, same request concurrency: the fleet client sends each
prompt through the router (validated sampling params, abort retries, per-response version check);
the plain client posts the same bodies straight to the engines, round robin, with an
asyncio.Semaphore of the same size. Rounds alternate between the two; the table shows medians and
the ratio fleet / plain (1.0 = no overhead). Also reports how long one pin of the fleet takes.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from pinned_eval.fleet import FleetClient, FleetConfig, SamplingParams, launch_cpu_fleet
from pinned_eval.fleet.generate import build_generate_body

ENGINES = 2
REQUESTS = 48
CONCURRENCY = 16
NEW_TOKENS = 16
ROUNDS = 5
KEY = secrets.token_urlsafe(32)  # the bench fleet's API and admin key
SAMPLING = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts() -> list[str]:
    return [f"What is {i} plus {i % 7}?" for i in range(REQUESTS)]


async def _fleet_round(client: FleetClient) -> tuple[float, int]:
    started = time.perf_counter()
    results = await asyncio.gather(*(client.generate(p, sampling_params=SAMPLING) for p in _prompts()))
    return time.perf_counter() - started, sum(r.meta_info.completion_tokens for r in results)


async def _plain_round(http: httpx.AsyncClient, engines: list[str]) -> tuple[float, int]:
    sem = asyncio.Semaphore(CONCURRENCY)
    targets = itertools.cycle(engines)

    async def one(prompt: str, url: str) -> int:
        async with sem:
            resp = await http.post(f"{url}/generate", json=build_generate_body(prompt, sampling_params=SAMPLING))
            resp.raise_for_status()
            return int(resp.json()["meta_info"]["completion_tokens"])

    started = time.perf_counter()
    tokens = await asyncio.gather(*(one(p, next(targets)) for p in _prompts()))
    return time.perf_counter() - started, sum(tokens)


async def _measure(engine_urls: list[str], router_url: str, snapshot: Path) -> dict[str, list[float]]:
    config = FleetConfig(max_concurrency=CONCURRENCY, router_ready_timeout_s=120, worker_timeout_s=120,
                         api_key=KEY, admin_api_key=KEY)
    out: dict[str, list[float]] = {"fleet": [], "plain": [], "pin": []}
    async with FleetClient(engine_urls, router_url, config=config) as client, httpx.AsyncClient(
        timeout=600, headers={"Authorization": f"Bearer {KEY}"}
    ) as http:
        for version in range(2):  # the first pin also warms both engines
            started = time.perf_counter()
            await client.pin(snapshot, f"bench-{version}")
            out["pin"].append(time.perf_counter() - started)
        await _plain_round(http, engine_urls)  # warm-up, not counted
        for _ in range(ROUNDS):
            for name, run in (("fleet", _fleet_round(client)), ("plain", _plain_round(http, engine_urls))):
                seconds, tokens = await run
                out[name].append(tokens / seconds)
    return out


def main() -> None:
    from engine.tiny_model import make_tiny_model, perturb_snapshot

    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        root = Path(tmp)
        base = make_tiny_model(root / "base", arch="llama", seed=0)
        snapshot = perturb_snapshot(base, root / "step_1", seed=1)
        fleet = launch_cpu_fleet(base, ENGINES, log_dir=root / "logs", api_key=KEY, admin_api_key=KEY,
                                 ready_timeout_s=300)
        try:
            assert fleet.router_url is not None
            out = asyncio.run(_measure(fleet.engine_urls, fleet.router_url, snapshot))
        finally:
            fleet.stop()
    fleet_tps, plain_tps = statistics.median(out["fleet"]), statistics.median(out["plain"])
    print(
        f"{ENGINES} CPU engines, {REQUESTS} requests x {NEW_TOKENS} new tokens, concurrency {CONCURRENCY}, "
        f"median of {ROUNDS} alternating rounds"
    )
    print("| client | tokens/s (median) | rounds | ratio vs plain |")
    print("|---|---|---|---|")
    print(
        f"| fleet client via sglang-router | {fleet_tps:.0f} | {', '.join(f'{x:.0f}' for x in out['fleet'])} | "
        f"{fleet_tps / plain_tps:.2f} |"
    )
    print(f"| plain httpx, engines direct | {plain_tps:.0f} | {', '.join(f'{x:.0f}' for x in out['plain'])} | 1.00 |")
    print(
        f"pin (load + read-back on {ENGINES} engines + router sync + 1-token probe): "
        f"{', '.join(f'{s:.2f} s' for s in out['pin'])}"
    )


if __name__ == "__main__":
    main()
