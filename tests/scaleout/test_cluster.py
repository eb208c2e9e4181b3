"""Guarantees on the multi-host harness (`tests.scaleout.harness`): hosts are network namespaces.

One cluster for the module (Postgres, Redis, moto S3, two `--no-services` API replicas behind a
balancer plus one services process, two worker hosts with a CPU fleet each). Two trainers on the
trainer host dispatch concurrently, one run per fleet, while one API replica is SIGKILLed
mid-burst. Checked: every point of both runs has exactly one flow run, terminal, and the
trainer's outcome for it (nothing lost, nothing doubled); measured points prove their pin; per
fleet the pin-to-generate windows never overlap (one version at a time) while measured points
of the two fleets run at the same time (both work in parallel; their pin windows' overlap is
printed, it depends on timing); the credential is accepted from another host and a
request without it is refused there. A worker host's worker SIGKILLed with two points in flight
there: the janitor deployment crashes exactly those points and retires their snapshots, and
`pinned-eval rerun` measures them in place (one flow run and one JSONL row per point).

Without root, `ip`, redis-server or prefect-redis the module skips, saying which is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from app.prefect_server import private_dir, use_server
from blocks import StagingBlock
from pinned_eval.polling import poll_until
from pinned_eval.sinks import JsonlSink
from tests.pointkit import write_step_snapshot
from tests.scaleout.harness import NODES, REPO, Cluster, ServiceUnavailableError, cluster
from tests.scaleout.netns import NetnsUnavailableError

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 40
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@pytest.fixture(scope="module")
def scale_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    try:
        with cluster(tmp_path_factory.mktemp("scaleout"), tiny_model) as c:
            yield c
        print("".join(f"{t:7.1f}s {p}\n" for p, t in c.timeline))
    except (NetnsUnavailableError, ServiceUnavailableError) as exc:
        pytest.skip(f"multi-host harness unavailable: {exc}")


@dataclass(frozen=True)
class RunSetup:
    run: str
    node: str
    config: dict


def save_run_blocks(c: Cluster, node: str, tag: str, *, keep_snapshots: int = 1) -> RunSetup:
    """Blocks of one training run measured on `node`'s fleet, staged on S3, cached on `node`."""
    run = f"{node[-1]}{tag}"
    names = c.save_run_blocks(run, node, keep_snapshots=keep_snapshots)
    trainer = c.host_dir("trainer")
    config = {
        "run": run, "blocks": names, "policy": "skip", "max_in_flight": 2, "steps": STEPS, "step_seconds": 0.3,
        "final": False,  # a final point waits for a slot, then runs: minutes on a loaded 2-core box
        "staging_root": f"s3://{c.bucket}/{run}", "spool_dir": str(trainer / "spool"),
        "deployment": f"eval-point/eval-point-{node}", "model": str(c.model), "out": str(trainer / f"{run}.out.json"),
        "drain_timeout_s": 240,
    }
    return RunSetup(run, node, config)


def _dispatched(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except FileNotFoundError:
        return 0


def _windows(c: Cluster, run: str) -> list[tuple[float, float, str]]:
    """(pin start, generate end, flow run name) of every measured point of `run`, from Postgres (epoch s)."""
    rows = c.pg.psql(
        "select fr.name, extract(epoch from min(tr.start_time) filter (where tr.name like 'pin-%')), "
        "extract(epoch from max(tr.end_time) filter (where tr.name like 'generate-%')) from flow_run fr "
        "join task_run tr "
        f"on tr.flow_run_id = fr.id where fr.name like '{run}/step-%' group by fr.name"
    )
    out = []
    for line in rows.splitlines():
        name, start, end = line.split("|")
        if start and end:
            out.append((float(start), float(end), name))
    return sorted(out)


def _point_windows(c: Cluster, run: str) -> list[tuple[float, float, str]]:
    """(start, end, name) of every flow run of `run` that pinned its fleet (a measured point)."""
    rows = c.pg.psql(
        "select fr.name, extract(epoch from fr.start_time), extract(epoch from fr.end_time) from flow_run fr "
        f"where fr.name like '{run}/step-%' and exists (select 1 from task_run tr where tr.flow_run_id = fr.id "
        "and tr.name like 'pin-%')"
    )
    return sorted((float(a), float(b), n) for n, a, b in (line.split("|") for line in rows.splitlines()))


def _overlap_s(a: list[tuple[float, float, str]], b: list[tuple[float, float, str]]) -> float:
    """Seconds during which a window of `a` and one of `b` were both open."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1, _ in a for s2, e2, _ in b)


@pytest.mark.timeout(900)
def test_two_trainers_two_fleets_through_replicas_one_replica_killed(scale_cluster: Cluster):
    c = scale_cluster
    tag = uuid.uuid4().hex[:6]
    runs = [save_run_blocks(c, node, tag) for node in NODES]
    trainers = [c.start_trainer(r.run, r.config) for r in runs]
    progress = Path(runs[0].config["out"]).with_suffix(".progress")

    # kill one API replica mid-burst (SIGKILL: no graceful shutdown, open connections reset)
    poll_until(lambda: _dispatched(progress) >= STEPS // 3 or not trainers[0].alive(), timeout_s=300,
               what="a third of the first trainer's dispatches")
    killed_at = time.time()
    os.killpg(c.api["api1"].pid, signal.SIGKILL)
    c.api["api1"].popen.wait(30)

    c.mark("replica api1 killed")
    for t in trainers:
        poll_until(lambda t=t: not t.alive(), timeout_s=420, what=lambda t=t: f"trainer {t.role}:\n{t.tail()}")
        assert t.popen.returncode == 0, t.tail()

    c.mark("trainers done")
    windows = {}
    for r in runs:
        result = json.loads(Path(r.config["out"]).read_text())
        outcomes = result["outcomes"]
        # the trainer's view: one terminal outcome per step, measured ones pinned to their step
        assert [o["step"] for o in outcomes] == list(range(STEPS)), outcomes
        assert all(o["state"] != "pending" and o["flow_runs"] == 1 for o in outcomes), outcomes
        measured = [o for o in outcomes if o["state"] == "measured"]
        assert measured, outcomes
        for o in measured:
            [m] = o["metrics"].values()
            assert m["eval/arith_add/weight_version/mean"] == o["step"], o
            assert m["eval/arith_add/weight_version/mixed_version_ratio"] == 0, o
        # the server's view (Postgres): exactly one flow run per step, each terminal
        rows = c.pg.psql(f"select name, state_type from flow_run where name like '{r.run}/step-%' order by name")
        names = [line.split("|") for line in rows.splitlines()]
        assert sorted(n for n, _ in names) == sorted(f"{r.run}/step-{s}" for s in range(STEPS)), rows
        assert {s for _, s in names} <= TERMINAL, rows
        windows[r.node] = poll_until(
            lambda r=r, n=len(measured): len(w := _windows(c, r.run)) == n and w, timeout_s=60,
            what=f"task runs of {r.run}'s measured points",
        )
        created_after_kill = c.pg.psql(
            f"select count(*) from flow_run where name like '{r.run}/step-%' and created > to_timestamp({killed_at})"
        )
        assert int(created_after_kill) > 0, f"{r.run}: no point after the replica was killed"

    # one version at a time per fleet: its pin..generate windows are disjoint
    for node, w in windows.items():
        for (_, end, a), (start, _, b) in itertools.pairwise(w):
            assert end <= start, (node, a, b)
    # both fleets worked in parallel: measured points of the two runs were running at the same time
    points = {r.node: _point_windows(c, r.run) for r in runs}
    overlap = _overlap_s(points[NODES[0]], points[NODES[1]])
    pin_overlap = _overlap_s(windows[NODES[0]], windows[NODES[1]])
    print(f"overlap of measured points: {overlap:.1f}s, of pin..generate windows: {pin_overlap:.1f}s;",
          "measured per fleet:", {n: len(w) for n, w in windows.items()})
    assert overlap > 0, points


def _kill_worker_host(c: Cluster, node: str) -> list[int]:
    """SIGKILL `node`'s worker and every process under it (the warm-start clients of its flow runs);
    return the PIDs its fork server had forked (handlers and flow-run processes: a handler SIGKILLs
    its flow-run process when the client's connection drops, `app.warm_start.server`)."""
    worker = psutil.Process(c.workers[node].pid)
    forked = [p.pid for p in psutil.Process(c.warm[node].pid).children(recursive=True)]
    for p in [*worker.children(recursive=True), worker]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    c.workers[node].popen.wait(30)
    return forked


@pytest.mark.timeout(900)
def test_worker_host_lost_mid_point_janitor_retires_and_points_rerun(scale_cluster: Cluster):
    """worker-b's worker SIGKILLed while two points run there: the janitor deployment (run by
    worker-a) crashes exactly those two, retires their staged snapshots into the keep-ring and
    records `skipped_crashed`; with the worker back, `pinned-eval rerun` retries both in place and
    they are measured: one flow run and one JSONL row per point."""
    from flows.janitor import last_activity

    c, node, steps = scale_cluster, "worker-b", [0, 1]
    r = save_run_blocks(c, node, f"lost{uuid.uuid4().hex[:4]}", keep_snapshots=len(steps))
    blocks, jsonl = r.config["blocks"], c.root / "sinks" / f"{r.run}.jsonl"
    # the points block in their log task on the sink's lock, held here: in flight, deterministically
    lock = open(jsonl.with_name(jsonl.name + ".lock"), "a")  # noqa: SIM115 - closed after the kill
    fcntl.flock(lock, fcntl.LOCK_EX)
    with use_server(c.api_url, c.host_dir("operator") / "home", auth_string=c.auth_string):
        store = StagingBlock.load(blocks["staging"]).staging()
        snapshots = private_dir(c.root / "snapshots")
        with get_client(sync_client=True) as client:
            try:
                dep = client.read_deployment_by_name(f"eval-point/eval-point-{node}")
                ids = {}
                for step in steps:
                    local = write_step_snapshot(c.model, str(snapshots / f"{r.run}-{step}"))
                    fr = client.create_flow_run_from_deployment(
                        dep.id, name=f"{r.run}/step-{step}", tags=[f"run:{r.run}", f"step:{step}"],
                        parameters={"run": r.run, "step": step, **blocks, "policy": "backpressure",
                                    "max_in_flight": len(steps),
                                    "source": {"kind": "staged", "path": store.put(local, r.run, step)}},
                    )
                    ids[step] = fr.id
                by_id = FlowRunFilter(id=FlowRunFilterId(any_=list(ids.values())))

                def held() -> bool:
                    running = all(client.read_flow_run(i).state.is_running() for i in ids.values())
                    tasks = client.read_task_runs(flow_run_filter=by_id)
                    return running and any(t.name.startswith("log-") and t.state.is_running() for t in tasks)

                poll_until(held, timeout_s=400, interval_s=1, what=f"both points running on {node}, one logging")
                forked = _kill_worker_host(c, node)
                c.mark(f"{node} worker killed mid-point")
                poll_until(lambda: not any(psutil.pid_exists(p) for p in forked), timeout_s=30,
                           what=f"{node}'s flow-run processes to die with their clients")
            finally:
                lock.close()
            states = {s: client.read_flow_run(i).state for s, i in ids.items()}
            assert all(st.is_running() for st in states.values()), f"zombies: nobody reports the loss {states}"

            # the janitor, a deployment run on the `default` queue: only worker-a polls it now
            window = 3.0
            poll_until(lambda: all((datetime.now(UTC) - last_activity(client, client.read_flow_run(i)))
                                   .total_seconds() > window + 1 for i in ids.values()),
                       timeout_s=60, what="the zombies to be quiet past the window")
            jan = client.create_flow_run_from_deployment(
                client.read_deployment_by_name("janitor/janitor").id,
                parameters={"heartbeat_window_s": window, "run": r.run, "staging": [blocks["staging"]]},
            )
            done = poll_until(lambda: (f := client.read_flow_run(jan.id)).state.is_final() and f, timeout_s=300,
                              interval_s=1, what="the janitor's run")
            assert done.state.is_completed(), done.state
            crashed = {s: client.read_flow_run(i).state for s, i in ids.items()}
            assert all(st.is_crashed() and st.message.startswith("janitor: no activity") for st in crashed.values()), (
                crashed
            )
        assert [(s.step, s.retired) for s in store.list(r.run)] == [(s, True) for s in steps]
        rows = sorted(JsonlSink(jsonl).read(r.run), key=lambda x: x.step)
        assert [(x.step, x.state, x.reason, x.flow_run_id) for x in rows] == [
            (s, "failed", "crashed", str(ids[s])) for s in steps
        ], rows

        # the host's worker is back; `pinned-eval rerun` (from the trainer host) retries each point in place
        c.start_worker(node)
        env = dict(os.environ, PREFECT_API_URL=c.api_url, PINNED_EVAL_API_AUTH_FILE=str(c.trainer_auth_file()),
                   PINNED_EVAL_HOME=str(private_dir(c.host_dir("trainer") / "home")), PYTHONPATH=str(REPO))
        env.pop("PREFECT_API_AUTH_STRING", None)
        reruns = []
        for s in steps:
            argv = [sys.executable, "-m", "app.cli", "rerun", "--run", r.run, "--step", str(s), "--wait", "--timeout",
                    "600"]
            log = c.host_dir("trainer") / f"rerun-{s}.log"
            reruns.append(c.net.start("trainer", f"rerun-{s}", argv, env=env, log=log, cwd=str(REPO)))
        for p in reruns:
            poll_until(lambda p=p: not p.alive(), timeout_s=700, what=lambda p=p: f"{p.role}:\n{p.tail()}")
            assert p.popen.returncode == 0, p.tail()
            assert f"retrying {r.run}/step-{p.role[6:]} in place" in p.tail(), p.tail()
        c.mark("janitor, reruns")
        # one terminal record per point: the same flow run, run twice, measured; one JSONL row, measured
        rows_pg = c.pg.psql(f"select name, state_type, run_count from flow_run where name like '{r.run}/step-%' "
                            "order by name")
        assert rows_pg.splitlines() == [f"{r.run}/step-{s}|COMPLETED|2" for s in steps], rows_pg
        rows = sorted(JsonlSink(jsonl).read(r.run), key=lambda x: x.step)  # file order: the order they ended
        assert [(x.step, x.state, x.flow_run_id) for x in rows] == [(s, "measured", str(ids[s])) for s in steps], rows
        assert [x.metrics["eval/arith_add/weight_version/mean"] for x in rows] == steps, rows
        assert [(s.step, s.retired) for s in store.list(r.run)] == [(s, True) for s in steps]


def test_credential_across_hosts(scale_cluster: Cluster):
    c = scale_cluster
    probe = (
        "import httpx, sys\n"
        "from pinned_eval.settings import PrefectApiSettings\n"
        "url = sys.argv[1]\n"
        "auth = PrefectApiSettings().auth_headers()\n"
        "print(httpx.post(url + '/flows/filter', json={}, timeout=30).status_code,"
        " httpx.post(url + '/flows/filter', json={}, headers=auth, timeout=30).status_code)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), PINNED_EVAL_API_AUTH_FILE=str(c.trainer_auth_file()))
    env.pop("PREFECT_API_AUTH_STRING", None)
    for url in (c.api_url, c.replica_url("api2")):
        out = c.run_in("trainer", [sys.executable, "-c", probe, url], env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["401", "200"], (url, out.stdout)


def test_fleet_reachable_only_on_its_host(scale_cluster: Cluster):
    """A fleet listens on its worker host's loopback: that host connects, the other one is refused."""
    from pinned_eval.fleet.launcher import LaunchedFleet

    c = scale_cluster
    router = LaunchedFleet.load(c.fleets["worker-a"]).router_url
    assert router is not None
    host, port = router.removeprefix("http://").rstrip("/").rsplit(":", 1)
    probe = (
        "import socket, sys\n"
        "try:\n"
        "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).close(); print('connected')\n"
        "except ConnectionRefusedError:\n"
        "    print('refused')\n"
    )
    seen = {node: c.run_in(node, [sys.executable, "-c", probe, host, port]).stdout.strip() for node in NODES}
    assert seen == {"worker-a": "connected", "worker-b": "refused"}, seen
