"""Benchmarks on the multi-host harness (`tests.scaleout.harness`): hosts are network namespaces.

Needs what the harness needs: root and `ip netns`, PostgreSQL and redis-server
(`scripts/ci-services.sh`), `prefect-redis` and `moto` (dev extra). One cluster serves all three:

1. **Throughput, one vs two worker hosts** (side by side in one run): `--points` points all on
   worker-a's deployment, then as many split over worker-a and worker-b (one run per host), each
   batch created at once (policy `backpressure`, snapshots staged on S3 beforehand, the tiny
   suite). Measured points per minute = measured points / (last end - first creation), from the
   server's timestamps; the ratio is two hosts over one. Each phase also reports how busy all the
   machine's CPUs were (/proc/stat) and the CPU seconds that cost per measured point: every host
   here shares the same cores, so a phase near 100 % busy is bounded by the cores, not the hosts.
2. **Request → Running of the real `eval-point` flow**, warm start (pool `pinned-eval`, the warm
   job template) vs cold process (pool `pinned-eval-cold`, Prefect's default process template),
   both workers on worker-a, requests alternating, each sent once the previous run ended, `--latency`
   of each. The bench holds the run's `eval-inflight-<run>` slot, so every point skips `busy` right
   after it reached Running (the measure ends there). Latency = the run's Running state timestamp
   minus the request's send time; p50 / p99 / max.
3. **Dispatch with a replica being killed**: an `EvalClient` on the operator host dispatches
   `--dispatches` points (policy `skip`, `max_in_flight` 2, in-loop export into S3, one step per
   0.1 s) through the balancer; after a third of them API replica `api1` is SIGKILLed. Dispatch
   wall time (export excluded) p50 / p99 / max before and after the kill.

`python -m bench multihost [--points N] [--latency N] [--dispatches N]`
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.burst import snapshot_exporter

REPO = Path(__file__).resolve().parents[1]
COLD_POOL = "pinned-eval-cold"


def pct(values: list[float], q: float) -> float:
    """The q-quantile of `values`, nearest rank (with n <= 100 the p99 is the max)."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def _stage(c: Any, names: dict[str, str], run: str, steps: range, export: Any, work: Path) -> dict[int, str]:
    """Upload a snapshot per step into the run's S3 staging root; step -> staged URL."""
    from blocks import StagingBlock

    store = StagingBlock.load(names["staging"]).staging()
    out = {}
    for step in steps:
        local = str(work / f"{run}-{step}")
        export(step, local)
        out[step] = store.put(local, run, step)
    return out


def _create(client: Any, node: str, run: str, names: dict[str, str], staged: dict[int, str], *, policy: str,
            max_in_flight: int, deployment: str | None = None) -> list[Any]:
    dep = client.read_deployment_by_name(deployment or f"eval-point/eval-point-{node}")
    runs = []
    for step, path in staged.items():
        params = {"run": run, "step": step, **names, "policy": policy, "max_in_flight": max_in_flight,
                  "source": {"kind": "staged", "path": path}}
        runs.append(client.create_flow_run_from_deployment(dep.id, name=f"{run}/step-{step}", parameters=params,
                                                           tags=[f"run:{run}", f"step:{step}"]))
    return runs


def _wait_final(client: Any, ids: list[Any], timeout_s: float) -> list[Any]:
    from pinned_eval.polling import poll_until

    def final() -> list[Any] | None:
        runs = [client.read_flow_run(i) for i in ids]
        return runs if all(r.state is not None and r.state.is_final() for r in runs) else None

    return poll_until(final, timeout_s=timeout_s, interval_s=1, what=f"{len(ids)} flow runs to end")


_HZ = os.sysconf("SC_CLK_TCK")  # /proc/stat's unit (jiffies per second)


def _cpu_times(stat: Path = Path("/proc/stat")) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (idle and iowait are not busy)."""
    fields = [int(x) for x in stat.read_text().splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def throughput(c: Any, client: Any, n: int, export: Any, work: Path) -> dict[str, dict[str, float]]:
    """Measured points per minute with one worker host, then with two (module docstring, 1)."""
    from pinned_eval.points import outcome_of

    out = {}
    variants = {"one worker host": {"worker-a": n}, "two worker hosts": {"worker-a": n // 2, "worker-b": n - n // 2}}
    for label, split in variants.items():
        batches = []  # everything staged before the first run is created: the span is the hosts' work
        for node, k in split.items():
            run = f"tp{node[-1]}{uuid.uuid4().hex[:5]}"
            names = c.save_run_blocks(run, node, keep_snapshots=k)
            batches.append((node, run, names, _stage(c, names, run, range(k), export, work)))
        created: list[Any] = []
        busy0, total0 = _cpu_times()
        for node, run, names, staged in batches:
            created += _create(client, node, run, names, staged, policy="backpressure", max_in_flight=len(staged))
        runs = _wait_final(client, [r.id for r in created], timeout_s=1800)
        busy1, total1 = _cpu_times()
        measured = [r for r in runs if outcome_of(r.state.type.value, r.state.name) == "measured"]
        span = (max(r.end_time for r in runs) - min(r.created for r in runs)).total_seconds()
        out[label] = {"points": len(runs), "measured": len(measured), "span_s": round(span, 1),
                      "measured_per_min": round(60 * len(measured) / span, 2),
                      "cpu_busy": round((busy1 - busy0) / (total1 - total0), 3),
                      "cpu_s_per_point": round((busy1 - busy0) / _HZ / max(1, len(measured)), 2)}
        c.mark(f"throughput, {label}")
        print(f"throughput, {label}: {out[label]}", flush=True)
    return out


def _cold_pool(c: Any, client: Any) -> None:
    """Pool `pinned-eval-cold` (Prefect's default process template), `eval-point-cold` on it, and
    its worker on worker-a."""
    import subprocess

    from pinned_eval.polling import poll_until

    env = c.client_env(c.host_dir("operator") / "home")
    subprocess.run([sys.executable, "-m", "prefect", "work-pool", "create", COLD_POOL, "--type", "process",
                    "--overwrite"], env=env, cwd=REPO, check=True, capture_output=True, timeout=300)
    client.create_deployment(
        flow_id=client.read_flow_by_name("eval-point").id, name="eval-point-cold", work_pool_name=COLD_POOL,
        entrypoint="flows/eval_point.py:eval_point",
        pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}],
    )
    argv = [sys.executable, "-m", "prefect", "worker", "start", "--pool", COLD_POOL, "--type", "process",
            "--name", "cold", "--limit", "2"]
    c.net.start("worker-a", "worker-cold", argv, env=c.worker_env("worker-a"),
                log=c.host_dir("worker-a") / "worker-cold.log", cwd=str(REPO))
    poll_until(lambda: client.read_workers_for_work_pool(COLD_POOL), timeout_s=300, what="the cold worker")


def latency(c: Any, client: Any, n: int, export: Any, work: Path) -> tuple[dict[str, list[float]], list[str]]:
    """Request → Running, warm and cold, `n` each, alternating (module docstring, 2)."""
    from prefect.concurrency.sync import concurrency

    from pinned_eval.points import inflight_limit_name, outcome_of
    from tasks.admission import ensure_limit

    _cold_pool(c, client)
    run = f"lat{uuid.uuid4().hex[:5]}"
    names = c.save_run_blocks(run, "worker-a", keep_snapshots=1)
    staged = _stage(c, names, run, range(2 * n), export, work)
    deployments = {"warm": "eval-point/eval-point-worker-a", "cold": "eval-point/eval-point-cold"}
    seen: dict[str, list[float]] = {"warm": [], "cold": []}
    odd: list[str] = []
    ensure_limit(inflight_limit_name(run), 1)
    with concurrency(inflight_limit_name(run), occupy=1, strict=True, lease_duration=60):  # every point: busy
        for step, path in staged.items():
            kind = "warm" if step % 2 == 0 else "cold"
            sent = datetime.now(UTC)
            [fr] = _create(client, "worker-a", run, names, {step: path}, policy="skip", max_in_flight=1,
                           deployment=deployments[kind])
            [done] = _wait_final(client, [fr.id], timeout_s=300)
            states = client.read_flow_run_states(fr.id)
            running = min(s.timestamp for s in states if s.type.value == "RUNNING")
            seen[kind].append((running - sent).total_seconds())
            print(f"request -> Running, {kind}, {done.name}: {seen[kind][-1]:.2f} s", flush=True)
            if outcome_of(done.state.type.value, done.state.name) != "skipped":
                odd.append(f"{done.name} ({kind}): {done.state.name} {done.state.message}")
    c.mark("request -> Running")
    return seen, odd


def dispatch_under_kill(c: Any, n: int, model: Path) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Dispatch wall times before and after `api1` is SIGKILLed (module docstring, 3)."""
    from pinned_eval.events import BlockNames
    from pinned_eval.settings import PrefectApiSettings
    from pinned_eval.snapshot.writer import write_snapshot
    from trainer_integration.client import EvalClient

    run = f"dk{uuid.uuid4().hex[:5]}"
    names = c.save_run_blocks(run, "worker-b", keep_snapshots=1)
    settings = PrefectApiSettings.from_environ({"PREFECT_API_URL": c.api_url, "PREFECT_API_AUTH_STRING": c.auth_string})
    from safetensors.torch import load_file

    tensors: dict = {}
    for shard in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(shard))
    named = sorted(tensors.items())
    client = EvalClient(run, settings=settings, blocks=BlockNames(**names), policy="skip", max_in_flight=2,
                        staging_root=f"s3://{c.bucket}/{run}", spool_dir=c.host_dir("operator") / f"spool-{run}",
                        deployment="eval-point/eval-point-worker-b")
    client.exporter = lambda step, dest: write_snapshot(named, dest, base_hf_dir=str(model), max_shard_bytes=64 * 1024,
                                                        storage_options=client.storage_options)
    seen: dict[str, list[float]] = {"before the kill": [], "after the kill": []}
    actions: dict[str, int] = {}
    pause = threading.Event()
    try:
        for step in range(n):
            if step == n // 3:
                os.killpg(c.api["api1"].pid, signal.SIGKILL)
                c.api["api1"].popen.wait(30)
                c.mark("api1 killed (dispatch bench)")
            pause.wait(0.1)
            r = client.dispatch(step)
            seen["after the kill" if step >= n // 3 else "before the kill"].append(
                r.stall_seconds - (r.export_time_seconds or 0.0)
            )
            actions[r.action] = actions.get(r.action, 0) + 1
    finally:
        client.close()
    return seen, actions


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench multihost", description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=8, help="points per throughput variant (default 8)")
    ap.add_argument("--latency", type=int, default=20, help="requests per latency variant (0: skip)")
    ap.add_argument("--dispatches", type=int, default=60, help="dispatches of the replica-kill phase (0: skip)")
    args = ap.parse_args(argv or [])
    from prefect import get_client

    from app.prefect_server import use_server
    from engine.tiny_model import make_tiny_model
    from tests.scaleout.harness import cluster

    t0 = time.monotonic()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-multihost-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model")
        export = snapshot_exporter(model)
        snaps = work / "snapshots"
        snaps.mkdir()
        with cluster(work / "cluster", model) as c:
            setup_s = time.monotonic() - t0
            with use_server(c.api_url, c.host_dir("operator") / "home", auth_string=c.auth_string), \
                    get_client(sync_client=True) as client:
                tp = throughput(c, client, args.points, export, snaps)
                lat, odd = latency(c, client, args.latency, export, snaps) if args.latency else ({}, [])
            disp, actions = dispatch_under_kill(c, args.dispatches, model) if args.dispatches else ({}, {})
            timeline = list(c.timeline)
    load1 = os.getloadavg()

    print(f"multihost: cluster up in {setup_s:.0f} s; load average at start {load0[0]:.1f}, at end {load1[0]:.1f} "
          f"({os.cpu_count()} CPUs)")
    print("\n| worker hosts | points | measured | span, s | measured points / min | CPU busy (all cores) "
          "| CPU s / measured point |\n|---|---|---|---|---|---|---|")
    for label, row in tp.items():
        print(f"| {label} | {row['points']} | {row['measured']} | {row['span_s']} | {row['measured_per_min']} "
              f"| {row['cpu_busy']:.0%} | {row['cpu_s_per_point']} |")
    one, two = (tp[k]["measured_per_min"] for k in ("one worker host", "two worker hosts"))
    print(f"| two / one | | | | **{two / one:.2f}x** (goal >= 1.8x) | | |" if one else "| two / one | | | | - | | |")
    print("\n| request -> Running, s | n | p50 | p99 | max |\n|---|---|---|---|---|")
    for kind, vals in lat.items():  # a phase skipped with 0 has no rows
        print(f"| {kind} | {len(vals)} | {statistics.median(vals):.2f} | {pct(vals, 0.99):.2f} | {max(vals):.2f} |")
    for line in odd:
        print(f"not a busy skip: {line}")
    print("\n| dispatch (export excluded), ms | n | p50 | p99 | max |\n|---|---|---|---|---|")
    for phase, vals in disp.items():
        ms = [v * 1000 for v in vals]
        print(f"| {phase} | {len(ms)} | {statistics.median(ms):.0f} | {pct(ms, 0.99):.0f} | {max(ms):.0f} |")
    print(f"dispatch actions: {actions}")
    print("\ntimeline:\n" + "".join(f"{t:7.1f}s {p}\n" for p, t in timeline))


if __name__ == "__main__":
    main(sys.argv[1:])
