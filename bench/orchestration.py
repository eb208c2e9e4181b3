"""Orchestration cost of one eval point, and event → Running latency of a triggered point.

1. Per-point overhead: the eval-point shape (admission through a global concurrency limit, then
   export, check, pin, generate, score, log, retire as Prefect tasks) with no-op task bodies,
   against the same seven steps as a bare asyncio pipeline, same process, same run.
2. Event → Running: `POST /api/events` with a `pinned-eval.point.requested`-shaped event to a
   deployment with an event trigger, run by a process worker polling every second; latency is the
   server's Running timestamp minus the event's `occurred` time.

`python -m bench orchestration [--points N] [--events N]`
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from tasks.admission import admitted

REPO = Path(__file__).resolve().parents[1]
STEPS = ("export", "check", "pin", "generate", "score", "log", "retire")


@task(cache_policy=NO_CACHE, task_run_name="{name}")
def noop(name: str) -> str:
    return name


@flow(name="bench-noop-point", flow_run_name="{run}/step-{step}")
def noop_point(run: str, step: int) -> None:
    with admitted(run, step, policy="backpressure", final=False, max_in_flight=4):
        for name in STEPS:
            noop(name)


async def _noop_async(name: str) -> str:
    await asyncio.sleep(0)
    return name


async def bare_point() -> None:
    for name in STEPS:
        await _noop_async(name)


def measure_overhead(points: int) -> tuple[float, float]:
    noop_point("bench", 0)  # warm-up: imports, limit creation, first client
    t0 = time.perf_counter()
    for step in range(1, points + 1):
        noop_point("bench", step)
    flow_s = (time.perf_counter() - t0) / points
    t0 = time.perf_counter()
    for _ in range(points):
        asyncio.run(bare_point())
    bare_s = (time.perf_counter() - t0) / points
    return flow_s, bare_s


def measure_event_latency(api_url: str, events: int) -> list[float]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter
    from prefect.events import DeploymentEventTrigger

    from pinned_eval.events import post_events

    subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "create", "bench-pool", "--type", "process", "--overwrite"],
        check=True, capture_output=True,
    )  # fmt: skip
    deployment_id = noop_point.from_source(source=str(REPO), entrypoint="bench/orchestration.py:noop_point").deploy(
        name="bench-noop",
        work_pool_name="bench-pool",
        triggers=[
            DeploymentEventTrigger(
                name="bench-requested",
                expect={"pinned-eval.point.requested"},
                match={"prefect.resource.id": "pinned-eval.run.bench-*"},
                parameters={"run": "{{ event.payload.run }}", "step": "{{ event.payload.step }}"},
            )
        ],
        print_next_steps=False,
    )
    env = dict(os.environ, PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="1")
    with open(Path(tempfile.gettempdir()) / f"bench-worker-{os.getpid()}.log", "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "bench-pool", "--type", "process"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    latencies = []
    try:
        time.sleep(3)  # let the worker register before the first event
        for i in range(events):
            run = f"bench-{uuid.uuid4().hex[:6]}"
            occurred = datetime.now(UTC)
            event = {
                "id": str(uuid.uuid4()),
                "occurred": occurred.isoformat().replace("+00:00", "Z"),
                "event": "pinned-eval.point.requested",
                "resource": {"prefect.resource.id": f"pinned-eval.run.{run}"},
                "payload": {"run": run, "step": i},
            }
            post_events(api_url, [event])
            running = _wait_running(get_client, FlowRunFilter, deployment_id, run)
            latencies.append((running - occurred).total_seconds())
    finally:
        os.killpg(worker.pid, 15)
        worker.wait(timeout=30)
    return latencies


def _wait_running(get_client, FlowRunFilter, deployment_id, run: str, timeout_s: float = 120.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as c:
        while time.monotonic() < deadline:
            runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(deployment_id={"any_": [deployment_id]}))
            for fr in runs:
                if fr.parameters.get("run") != run:
                    continue
                states = c.read_flow_run_states(fr.id)
                running = [s.timestamp for s in states if s.type.value == "RUNNING"]
                if running:
                    return running[0]
            time.sleep(0.25)
    raise TimeoutError(f"no Running state for {run} within {timeout_s}s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench orchestration")
    parser.add_argument("--points", type=int, default=10)
    parser.add_argument("--events", type=int, default=5)
    args = parser.parse_args(argv or [])
    from app.prefect_server import running_server

    with tempfile.TemporaryDirectory() as home, running_server(Path(home)) as server:
        flow_s, bare_s = measure_overhead(args.points)
        latencies = measure_event_latency(server.api_url, args.events)
    print(f"{'measure':44} {'value':>12}")
    print(f"{'eval-point shape, no-op tasks (s/point)':44} {flow_s:12.3f}")
    print(f"{'bare asyncio pipeline (s/point)':44} {bare_s:12.6f}")
    print(f"{'orchestration overhead (s/point)':44} {flow_s - bare_s:12.3f}")
    print(f"{'ratio flow / bare':44} {flow_s / bare_s:12.0f}")
    print(f"{'event -> Running p50 (s)':44} {statistics.median(latencies):12.2f}")
    print(f"{'event -> Running max (s)':44} {max(latencies):12.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
