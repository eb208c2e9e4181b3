"""Orchestration cost of one eval point, and event → Running latency of a triggered point.

1. Per-point overhead: the eval-point shape (admission through a global concurrency limit, then
   export, check, pin, generate, score, log, retire as Prefect tasks) with no-op task bodies,
   against the same seven steps as a bare asyncio pipeline, same process, same run.
2. Request → Running, before/after side by side in one run (requests alternate between them):
   - `event, worker 1 s` (before): `POST /api/events` with a `pinned-eval.point.requested`-shaped
     event to a deployment with an event trigger, run by a process worker polling every 1 s;
   - `direct, worker 0.5 s` (after, what `EvalClient` and `app.stack` do now): `POST
     /deployments/{id}/create_flow_run` with the point's idempotency key (the event only as a
     fallback), run by a process worker polling every `WORKER_QUERY_SECONDS`, on its own pool;
   - `direct, ..., warm` (what `app.stack` does now): the same, on a pool whose flow runs go
     through the warm start (`app.warm_start`: a thin client hands the run to a fork server that
     imported Prefect and the flow once) instead of a fresh `python -m prefect.engine`.
   Each request waits for the previous run to end, so it meets a quiet server.
   Latency is the server's Running timestamp minus the request's send time, broken down by the
   run's state timestamps: request → run created (trigger service) → Pending (worker poll) →
   Running (flow-run process start, imports, engine). Also `import prefect` and
   `import flows.eval_point` in a fresh interpreter (part of the process start).

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

from app.stack import WORKER_QUERY_SECONDS
from app.warm_start import SOCKET_ENV, server_command, wait_listening, write_job_template
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


PATHS = {  # before: the trigger path with the worker polling every 1 s; then direct runs; now warm
    "event, worker 1 s": ("bench-pool-event", 1.0),
    f"direct, worker {WORKER_QUERY_SECONDS:g} s": ("bench-pool-direct", WORKER_QUERY_SECONDS),
    f"direct, {WORKER_QUERY_SECONDS:g} s, warm": ("bench-pool-warm", WORKER_QUERY_SECONDS),
}
PHASES = ("created", "pending", "running")


def _deploy(pool: str, name: str, triggered: bool) -> str:
    from prefect.events import DeploymentEventTrigger

    template = []
    if pool.endswith("-warm"):
        template = ["--base-job-template", str(write_job_template(Path(tempfile.mkdtemp()) / "warm.json"))]
    subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "create", pool, "--type", "process", "--overwrite", *template],
        check=True, capture_output=True,
    )
    trigger = DeploymentEventTrigger(
        name="bench-requested",
        expect={"pinned-eval.point.requested"},
        match={"prefect.resource.id": "pinned-eval.run.bench-*"},
        parameters={"run": "{{ event.payload.run }}", "step": "{{ event.payload.step }}"},
    )
    return str(
        noop_point.from_source(source=str(REPO), entrypoint="bench/orchestration.py:noop_point").deploy(
            name=name, work_pool_name=pool, triggers=[trigger] if triggered else [], print_next_steps=False
        )
    )


def _worker(pool: str, query_s: float, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PREFECT_WORKER_QUERY_SECONDS=str(query_s), PREFECT_WORKER_PREFETCH_SECONDS=str(query_s))
    if pool.endswith("-warm"):
        env[SOCKET_ENV] = str(log.with_suffix(".sock"))
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )


def measure_event_latency(api_url: str, events: int) -> dict[str, list[dict[str, float]]]:
    """Per path, per request: seconds from the request to each phase (`created`, `pending`, `running`)."""
    from pinned_eval.settings import PrefectApiSettings
    from trainer_integration.rest import PrefectRest, api_client

    deployments = {
        label: _deploy(pool, f"bench-noop-{i}", triggered=label.startswith("event"))
        for i, (label, (pool, _)) in enumerate(PATHS.items())
    }
    tmp = Path(tempfile.mkdtemp(prefix="bench-worker-"))  # private (0700): the fork server's socket lives here
    sock = tmp / f"bench-worker-bench-pool-warm-{os.getpid()}.sock"
    with open(sock.with_suffix(".fork.log"), "w") as out:
        warm = subprocess.Popen(server_command(sock), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    wait_listening(sock, warm)
    workers = [_worker(pool, q, tmp / f"bench-worker-{pool}-{os.getpid()}.log") for pool, q in PATHS.values()]
    out: dict[str, list[dict[str, float]]] = {label: [] for label in PATHS}
    http = api_client(PrefectApiSettings(), timeout_s=30)  # with the server's credential (running_server)
    rest = PrefectRest(api_url, http)  # retries a busy server's 503 on both paths
    try:
        time.sleep(3)  # let the workers register before the first request
        for i in range(events):
            for label, deployment_id in deployments.items():
                run = f"bench-{uuid.uuid4().hex[:6]}"
                sent = datetime.now(UTC)
                if label.startswith("event"):
                    event = {
                        "id": str(uuid.uuid4()),
                        "occurred": sent.isoformat().replace("+00:00", "Z"),
                        "event": "pinned-eval.point.requested",
                        "resource": {"prefect.resource.id": f"pinned-eval.run.{run}"},
                        "payload": {"run": run, "step": i},
                    }
                    rest.post_events([event]).raise_for_status()
                else:
                    body = {"name": f"{run}/step-{i}", "parameters": {"run": run, "step": i},
                            "idempotency_key": str(uuid.uuid4())}
                    rest.create_flow_run(deployment_id, body).raise_for_status()
                phases, flow_run_id = _wait_running(http, api_url, deployment_id, run)
                out[label].append({k: (t - sent).total_seconds() for k, t in phases.items()})
                _wait_terminal(http, api_url, flow_run_id)  # the next request meets a quiet server
    finally:
        http.close()
        for worker in [*workers, warm]:
            os.killpg(worker.pid, 15)
        for worker in [*workers, warm]:
            worker.wait(timeout=30)
    return out


def _wait_terminal(http, api_url: str, flow_run_id: str, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        resp = http.get(f"{api_url}/flow_runs/{flow_run_id}")
        if resp.status_code == 200 and resp.json()["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return
        time.sleep(0.1)
    raise TimeoutError(f"flow run {flow_run_id} not terminal within {timeout_s}s")


def _wait_running(  # type: ignore[no-untyped-def]
    http, api_url: str, deployment_id: str, run: str, timeout_s: float = 120.0
) -> tuple[dict[str, datetime], str]:
    deadline = time.monotonic() + timeout_s
    flt = {"deployments": {"id": {"any_": [deployment_id]}}, "limit": 200}
    while time.monotonic() < deadline:
        resp = http.post(f"{api_url}/flow_runs/filter", json=flt)
        for fr in resp.json() if resp.status_code == 200 else []:  # a busy server's 503: read again
            if fr["parameters"].get("run") != run:
                continue
            states_resp = http.get(f"{api_url}/flow_run_states/", params={"flow_run_id": fr["id"]})
            if states_resp.status_code != 200:
                continue
            states = states_resp.json()
            at = {s["type"]: datetime.fromisoformat(s["timestamp"]) for s in reversed(states)}
            if "RUNNING" in at:
                created = datetime.fromisoformat(fr["created"])
                phases = {"created": created, "pending": at.get("PENDING", at["RUNNING"]), "running": at["RUNNING"]}
                return phases, str(fr["id"])
        time.sleep(0.1)
    raise TimeoutError(f"no Running state for {run} within {timeout_s}s")


def import_seconds(module: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, check=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench orchestration")
    parser.add_argument("--points", type=int, default=10)
    parser.add_argument("--events", type=int, default=5)
    args = parser.parse_args(argv or [])
    from app.prefect_server import running_server

    with tempfile.TemporaryDirectory() as home, running_server(Path(home)) as server:
        flow_s, bare_s = measure_overhead(args.points)
        latencies = measure_event_latency(server.api_url, args.events)
    imports = {m: import_seconds(m) for m in ("prefect", "flows.eval_point")}
    print(f"{'measure':44} {'value':>12}")
    print(f"{'eval-point shape, no-op tasks (s/point)':44} {flow_s:12.3f}")
    print(f"{'bare asyncio pipeline (s/point)':44} {bare_s:12.6f}")
    print(f"{'orchestration overhead (s/point)':44} {flow_s - bare_s:12.3f}")
    print(f"{'ratio flow / bare':44} {flow_s / bare_s:12.0f}")
    for module, secs in imports.items():
        print(f"{'python -c import ' + module + ' (s)':44} {secs:12.2f}")
    labels = list(latencies)
    print(f"\nrequest -> phase, seconds (n={args.events} each)   " + "".join(f"{label:>26}" for label in labels))
    for phase in PHASES:
        for stat, fn in (("p50", statistics.median), ("max", max)):
            cells = "".join(f"{fn([r[phase] for r in latencies[label]]):26.2f}" for label in labels)
            print(f"{'-> ' + phase + ' ' + stat:44}{cells}")
    before, direct, warm = (statistics.median([r["running"] for r in latencies[label]]) for label in labels)
    print(f"{'Running p50 ratio direct / event':44}{direct / before:26.2f}")
    print(f"{'Running p50 ratio warm / direct (cold)':44}{warm / direct:26.2f}")
    print(f"{'Running p50 ratio warm / event':44}{warm / before:26.2f}")
    print(f"\nload average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main(sys.argv[1:])
