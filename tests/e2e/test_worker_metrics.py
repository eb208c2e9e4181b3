"""Issue 33 item 2: a real scrape of `pinned-eval worker --metrics-port 0` counts exactly the points
its flow runs ended. The real CLI runs on a fresh home and a pool of its own (as in
test_worker_stop); four points of the external posture go through the worker's flow-run
processes: one measured, two skipped (the backend's `quota`, and a snapshot without `.complete`:
`ckpt_missing`), one failed (the backend crashes). The endpoint is read over HTTP and parsed
with prometheus_client's own parser."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from prefect import get_client
from prometheus_client.parser import text_string_to_metric_families

from app.stack import LocalStack
from app.warm_start import write_job_template
from pinned_eval.polling import poll_until
from tests.conftest import free_port
from tests.deploykit import REPO, prefect_cli
from tests.e2e.test_worker_stop import WorkerCli, _deployment_on, _up, fresh_home
from tests.pointkit import PointEnv, save_point_blocks, write_step_snapshot

pytestmark = pytest.mark.e2e
BACKEND = "tests.hosted_backends:LifecycleBackend"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@pytest.fixture
def metrics_worker(prefect_server: str, tmp_path: Path) -> Iterator[tuple[WorkerCli, str]]:
    home = fresh_home(tmp_path, prefect_server)
    pool = f"metrics-{uuid.uuid4().hex[:8]}"
    template = write_job_template(tmp_path / "warm-template.json")
    made = prefect_cli("work-pool", "create", pool, "--type", "process", "--base-job-template", str(template),
                       env=dict(os.environ))
    assert made.returncode == 0, made.stdout + made.stderr
    log = tmp_path / "cli.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PINNED_EVAL_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "worker", "--pool", pool, "--metrics-port", "0"],
                                cwd=REPO, env=dict(env, PINNED_EVAL_HOME=str(home)), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    cli = WorkerCli(proc, LocalStack(home), pool, log)
    try:
        poll_until(lambda: _up(cli), timeout_s=180, interval_s=0.5, what=lambda: f"worker up; log:\n{log.read_text()}")
        found = re.search(r"^metrics: (http://127\.0\.0\.1:\d+/metrics)$", log.read_text(), re.M)
        assert found, log.read_text()
        yield cli, found.group(1)
    finally:
        for p in [psutil.Process(proc.pid), *cli.descendants()] if proc.poll() is None else []:
            p.kill()
        proc.wait(timeout=30)


def _scrape(url: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    text = httpx.get(url, timeout=10).text
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_a_scrape_after_measured_skipped_and_failed_points_counts_each_exactly(
    metrics_worker: tuple[WorkerCli, str], tiny_model: Path, tmp_path: Path
) -> None:
    from blocks import ExternalBackendBlock, FleetBlock, StagingBlock

    cli, url = metrics_worker
    dead = f"http://127.0.0.1:{free_port()}"  # the external posture never touches the fleet
    env = save_point_blocks(tmp_path, FleetBlock(name=f"d{uuid.uuid4().hex[:6]}", mode="attach",
                                                 engine_urls=[dead], router_url=dead))
    lifecycle = str(tmp_path / "lifecycle.jsonl")
    for mode in ("measure", "quota", "boom"):
        ExternalBackendBlock(backend=BACKEND, options={"log": lifecycle, "mode": mode}).save(f"{mode}-{env.run}")
    staging = StagingBlock.load(env.blocks["staging"]).staging()
    sources = {step: write_step_snapshot(tiny_model, staging.path_for(env.run, step)) for step in (1, 2, 3)}
    incomplete = Path(staging.path_for(env.run, 4))
    incomplete.mkdir(parents=True)
    (incomplete / "config.json").write_text("{}")  # no `.complete`: ckpt_missing
    sources[4] = str(incomplete)
    modes = {1: "measure", 2: "quota", 3: "boom", 4: "measure"}
    deployment = _deployment_on(cli.pool)
    assert _scrape(url)["pinned_eval_points"] == [], "nothing counted before a point ran"

    with get_client(sync_client=True) as c:
        ids = [c.create_flow_run_from_deployment(deployment, parameters=env.params(
            step, source={"kind": "staged", "path": sources[step]}, posture="external",
            backend_block=f"{modes[step]}-{env.run}")).id for step in modes]

    def states() -> list[str] | None:
        with get_client(sync_client=True) as c:
            found = [c.read_flow_run(i).state for i in ids]
        types = [s.type.value if s else "" for s in found]
        return [f"{s.type.value}/{s.name}" for s in found if s] if set(types) <= TERMINAL else None

    ended = poll_until(states, timeout_s=240, interval_s=0.5,
                       what=lambda: f"4 points ended; log:\n{cli.log.read_text()}")
    assert ended == ["COMPLETED/Completed", "COMPLETED/Skipped", "FAILED/Failed", "COMPLETED/Skipped"]

    metrics = _scrape(url)
    assert metrics["pinned_eval_points"] == [
        ("pinned_eval_points_total", {"run": env.run, "outcome": "failed", "reason": "crashed"}, 1.0),
        ("pinned_eval_points_total", {"run": env.run, "outcome": "measured", "reason": ""}, 1.0),
        ("pinned_eval_points_total", {"run": env.run, "outcome": "skipped", "reason": "ckpt_missing"}, 1.0),
        ("pinned_eval_points_total", {"run": env.run, "outcome": "skipped", "reason": "quota"}, 1.0),
    ]
    counts = {s[1]["outcome"]: s[2] for s in metrics["pinned_eval_point_duration_seconds"]
              if s[0] == "pinned_eval_point_duration_seconds_count"}
    assert counts == {"failed": 1.0, "measured": 1.0, "skipped": 2.0}
    assert metrics["pinned_eval_points_in_flight"] == [], "every point ended: none in flight"
    assert metrics["pinned_eval_tracker_exports_waiting"] == [("pinned_eval_tracker_exports_waiting", {}, 0.0)]
    assert metrics["pinned_eval_pin_duration_seconds"] == [], "the external posture pins no fleet"
    assert metrics["pinned_eval_metrics_unreadable_events"] == [
        ("pinned_eval_metrics_unreadable_events_total", {}, 0.0)]
    assert _scrape(url)["pinned_eval_points"] == metrics["pinned_eval_points"], "a second scrape counts nothing twice"


def test_a_fleet_point_records_its_pin_and_its_outcome(
    prefect_server: str, point_env: PointEnv, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process, with the worker's variable set: the fleet posture's pin is observed once, by fleet."""
    from blocks import FleetBlock, StagingBlock
    from flows.eval_point import eval_point
    from pinned_eval.prometheus import METRICS_DIR_ENV, serve_metrics

    root = tmp_path / "metrics"
    monkeypatch.setenv(METRICS_DIR_ENV, str(root))
    server, url = serve_metrics(root, 0)
    try:
        dest = StagingBlock.load(point_env.blocks["staging"]).staging().path_for(point_env.run, 2)
        source = {"kind": "staged", "path": write_step_snapshot(tiny_model, dest)}
        state = eval_point(**point_env.params(2, source=source), return_state=True)
        assert state.name == "Completed", state.message
        metrics = _scrape(url)
    finally:
        server.shutdown()
    fleet = FleetBlock.load(point_env.blocks["fleet"]).name
    assert metrics["pinned_eval_points"] == [
        ("pinned_eval_points_total", {"run": point_env.run, "outcome": "measured", "reason": ""}, 1.0)]
    pins = [(s[1], s[2]) for s in metrics["pinned_eval_pin_duration_seconds"]
            if s[0] == "pinned_eval_pin_duration_seconds_count"]
    assert pins == [({"fleet": fleet}, 1.0)]
    assert metrics["pinned_eval_points_in_flight"] == []
