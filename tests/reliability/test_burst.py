"""Burst: 200 eval-point dispatches from one trainer against the real server, worker and CPU fleet.

Policy `skip`, at most 2 points in flight, one dispatch per 0.1 s training step, in-loop export
of a tiny snapshot for every admitted point, a tiny suite (1 dataset, 2 prompts, 1 new token)
so the fleet's work per point is close to nothing. What a 2-core box can run as real flow runs
in that time is a handful of points; the rest find 2 points in flight and are recorded by the
trainer as `busy` skips (Completed / "Skipped" flow runs) — by design of the skip policy, and the
load this puts on the server (one admission query and one flow-run creation per step, plus the
real points' runs) is the point of the test.

Checked: every step ends with exactly one terminal record (one flow run, measured or skipped
with a reason, and one JSONL record); staging, sampled every 50 ms, never holds more than
`keep_snapshots + max_in_flight` snapshots of the run, and holds at most `keep_snapshots` once
drained; `/api/health`, sampled every 250 ms during the burst, answered every time (its max
latency is printed, not asserted).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.burst import run_burst, snapshot_exporter, tiny_suite
from blocks import FleetBlock
from pinned_eval.events import BlockNames
from pinned_eval.sinks import JsonlSink
from tests.deploykit import Deployed
from tests.pointkit import CpuFleet, save_point_blocks
from trainer_integration.client import EvalClient

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 200
MAX_IN_FLIGHT = 2
KEEP = 2


@pytest.mark.timeout(300)
def test_burst_of_200_dispatches_records_every_step_once_within_the_staging_bound(
    prefect_server: str, deployed: Deployed, cpu_fleet: CpuFleet, tiny_model: Path, tmp_path: Path
):
    fleet = FleetBlock(name="burst", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, suite=tiny_suite(), keep_snapshots=KEEP)
    with EvalClient(
        env.run,
        deployed.api_url,
        blocks=BlockNames(**env.blocks),
        policy="skip",
        max_in_flight=MAX_IN_FLIGHT,
        staging_root=env.staging_root,
        exporter=snapshot_exporter(tiny_model),
        spool_dir=tmp_path / "spool",
    ) as client:
        report = run_burst(
            client, api_url=deployed.api_url, staging_root=env.staging_root, keep_snapshots=KEEP, steps=STEPS
        )
        rejected = client.spool.rejected()
        pending = client.spool.pending()
    print("burst:", report.summary())

    assert not rejected and not pending
    assert [r.step for r in report.dispatched] == list(range(STEPS))
    assert {r.action for r in report.dispatched} <= {"requested", "skipped_busy"}
    # one terminal record per step: one flow run, measured or skipped with its reason
    by_step = {o.step: o for o in report.outcomes}
    assert sorted(by_step) == list(range(STEPS))
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

    rows = JsonlSink(env.jsonl).read(env.run)
    per_step: dict[int, set[str]] = {}
    for row in rows:
        per_step.setdefault(row.step, set()).add(row.state)
    assert sorted(per_step) == list(range(STEPS))
    one_dataset = [r.step for r in rows]
    assert len(one_dataset) == STEPS  # one dataset: exactly one row per step, whatever the outcome
    for step, states in per_step.items():
        expected = "measured" if by_step[step].state == "measured" else "skipped"
        assert states == {expected}, (step, states)

    # staging stays bounded during the burst and drains to the keep-ring
    assert report.staging_high_water <= KEEP + MAX_IN_FLIGHT, report.staging_samples
    assert report.staging_samples[-1] <= KEEP
    # the server answered every probe during the burst
    assert not report.health_errors, report.health_errors[:5]
    assert len(report.health_latencies) >= 10
