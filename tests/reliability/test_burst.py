"""Burst: 200 eval-point dispatches from one trainer against the real server, worker and CPU fleet.

Policy `skip`, at most 2 points in flight, one dispatch per 0.05 s training step, in-loop export
of a tiny snapshot for every admitted point, a tiny suite (1 dataset, 2 prompts, 1 new token)
so the fleet's work per point is close to nothing. A 2-core box runs only a handful of real
flow runs in that time; the other steps find 2 points in flight and are recorded by the trainer
as `busy` skips (Completed / "Skipped" flow runs, no export) — by design of the skip policy. The
load on the server (an admission query and a flow-run creation per step, plus the real points'
runs) is what is tested. The burst runs once per module (`bench.burst.run_burst`); each test
checks one property of it:

- every step ends with exactly one terminal record (one flow run, measured or skipped with a
  reason, and one JSONL record); the final point is measured;
- staging, sampled every 50 ms, never holds more than `keep_snapshots + max_in_flight`
  snapshots of the run, and at most `keep_snapshots` once drained;
- `/api/health`, sampled every 250 ms, answered every probe (max latency printed, not asserted);
- admission counts only real points: a step is skipped `busy` only while `max_in_flight` points
  are in flight (the trainer's own skip records are terminal and must not count).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.burst import BurstReport, run_burst, snapshot_exporter, tiny_suite
from blocks import FleetBlock
from pinned_eval.events import BlockNames
from pinned_eval.sinks import JsonlSink
from tests.deploykit import Deployed
from tests.pointkit import CpuFleet, PointEnv, save_point_blocks
from tests.prefect_server import prefect_rest_client
from trainer_integration.client import EvalClient

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 200
MAX_IN_FLIGHT = 2
KEEP = 2


@dataclass(frozen=True)
class Burst:
    report: BurstReport
    env: PointEnv
    api_url: str
    undelivered: int  # spool entries still pending or rejected after the drain


@pytest.fixture(scope="module")
def burst(
    prefect_server: str, deployed: Deployed, cpu_fleet: CpuFleet, tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Burst]:
    tmp = tmp_path_factory.mktemp("burst")
    fleet = FleetBlock(name="burst", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp, fleet, suite=tiny_suite(), keep_snapshots=KEEP)
    with EvalClient(
        env.run, deployed.api_url, blocks=BlockNames(**env.blocks), policy="skip", max_in_flight=MAX_IN_FLIGHT,
        staging_root=env.staging_root, exporter=snapshot_exporter(tiny_model), spool_dir=tmp / "spool",
    ) as client:
        report = run_burst(
            client, api_url=deployed.api_url, staging_root=env.staging_root, keep_snapshots=KEEP, steps=STEPS,
            step_seconds=0.05, drain_timeout_s=150,
        )
        undelivered = len(client.spool.rejected()) + len(client.spool.pending())
    print("burst:", report.summary())
    yield Burst(report, env, deployed.api_url, undelivered)


def test_every_step_ends_with_exactly_one_terminal_record(burst: Burst):
    report = burst.report
    assert burst.undelivered == 0
    assert [r.step for r in report.dispatched] == list(range(STEPS))
    assert {r.action for r in report.dispatched} <= {"requested", "skipped_busy"}
    by_step = {o.step: o for o in report.outcomes}
    assert sorted(by_step) == list(range(STEPS))
    lost = [o.step for o in report.outcomes if o.state == "pending"]
    assert not lost, f"steps without a terminal record: {lost}; {_automation_failures(burst.api_url)}"
    for o in by_step.values():
        assert o.flow_runs == 1, o
        assert o.state in ("measured", "skipped"), o
        if o.state == "skipped":
            assert o.reason, o
    for r in report.dispatched:  # the trainer's own busy skips are exactly its skip records
        if r.action == "skipped_busy":
            assert by_step[r.step].state == "skipped" and by_step[r.step].reason == "busy"
    assert by_step[STEPS - 1].state == "measured"  # the final point is never skipped
    assert report.count("measured") >= 2  # real flow runs ran, not only skip records

    rows = JsonlSink(burst.env.jsonl).read(burst.env.run)
    assert sorted(r.step for r in rows) == list(range(STEPS))  # one dataset: one row per step
    for row in rows:
        expected = "measured" if by_step[row.step].state == "measured" else "skipped"
        assert row.state == expected, row


def test_staging_never_exceeds_keep_plus_in_flight(burst: Burst):
    samples = burst.report.staging_samples
    assert len(samples) >= 100  # sampled throughout the burst
    assert max(samples) <= KEEP + MAX_IN_FLIGHT, samples
    assert samples[-1] <= KEEP  # drained: only the keep-ring remains


def test_server_answers_health_probes_during_the_burst(burst: Burst):
    assert not burst.report.health_errors, burst.report.health_errors[:5]
    assert len(burst.report.health_latencies) >= 20


def test_admission_counts_only_real_points_in_flight(burst: Burst):
    """Exactly the steps that saw `MAX_IN_FLIGHT` real points in flight are busy, and the peak the
    admission counted is exactly `MAX_IN_FLIGHT`: counted skip records would push it past the bound
    (up to 117 once), a skip one slot early would show a busy step at `MAX_IN_FLIGHT - 1`."""
    dispatched = burst.report.dispatched
    counted = [(r.step, r.action, r.in_flight, r.admitted_offline) for r in dispatched]
    busy = {r.step for r in dispatched if r.action == "skipped_busy"}
    # with a fresh view, a non-final step is busy if and only if the bound was reached
    at_bound = {r.step for r in dispatched if r.in_flight == MAX_IN_FLIGHT and not r.admitted_offline}
    assert busy == at_bound - {STEPS - 1}, counted
    assert busy, counted  # 0.05 s steps outrun the points: the bound was reached
    assert burst.report.admission_in_flight_max == MAX_IN_FLIGHT, counted
    assert {r.in_flight for r in dispatched if r.action == "skipped_busy"} == {MAX_IN_FLIGHT}, counted
    requested = [r for r in dispatched if r.action == "requested"]
    assert len(requested) + len(busy) == STEPS, counted
    assert all(r.in_flight < MAX_IN_FLIGHT or r.admitted_offline for r in requested), counted
    final = dispatched[-1]  # the final point waits for a slot instead of skipping
    assert (final.step, final.action) == (STEPS - 1, "requested"), final


def _automation_failures(api_url: str) -> list[dict]:
    """Diagnostics: trigger actions the server failed to run (a point requested but never created)."""
    body = {"filter": {"event": {"name": ["prefect.automation.action.failed"]}}, "limit": 50}
    with prefect_rest_client() as http:
        resp = http.post(f"{api_url}/events/filter", json=body)
    resp.raise_for_status()
    return [{"occurred": e["occurred"], "payload": e.get("payload")} for e in resp.json()["events"]]
