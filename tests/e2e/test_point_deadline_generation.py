"""A fleet point's deadline that fires while it holds the fleet lock, during generation (a stalled
router): the point is `timed_out`, the lock is free, its snapshot retired, and the next point is
measured on the same fleet."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
from prefect import get_client

from blocks import EvalSuiteBlock, FleetBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.points import inflight_limit_name
from pinned_eval.sinks import JsonlSink
from tests.faults import RecordingProxy
from tests.pointkit import SMALL_SUITE, PointEnv, save_point_blocks, write_step_snapshot

pytestmark = pytest.mark.e2e


class StallingRouter(RecordingProxy):
    """A router proxy that holds every `/generate` until `release` is set (then forwards it)."""

    def __init__(self, router_url: str) -> None:
        self.generating, self.release = threading.Event(), threading.Event()
        super().__init__(router_url)

    def intercept(self, path: str) -> bytes | None:
        if path == "/generate":
            self.generating.set()
            self.release.wait()
        return None


def _staged(env: PointEnv, step: int, tiny: Path) -> dict[str, str]:
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)
    write_step_snapshot(tiny, dest)
    return {"kind": "staged", "path": dest}


# pytest-timeout's thread method: its default (signal) method holds SIGALRM, and Prefect then
# enforces the point's deadline by an exception injected into this thread, which waits for the
# event loop's blocked `select` (until the held request times out, ~40 s on); with SIGALRM free, the
# deadline interrupts it at once, as in a flow-run process
@pytest.mark.timeout(300, method="thread")
def test_a_deadline_during_generation_times_out_and_frees_the_fleet(
    prefect_server: str, cpu_fleet, tmp_path: Path, tiny_model: Path  # type: ignore[no-untyped-def]
) -> None:
    router = StallingRouter(cpu_fleet.router_url)
    try:
        fleet = FleetBlock(name=f"stall{uuid.uuid4().hex[:6]}", mode="attach", engine_urls=cpu_fleet.engine_urls,
                           router_url=router.url, **cpu_fleet.block_keys())
        env = save_point_blocks(tmp_path, fleet, keep_snapshots=0, point_timeout_seconds=20)
        src = _staged(env, 51, tiny_model)
        state = eval_point(**env.params(51, source=src, max_in_flight=1), return_state=True)
        assert router.generating.is_set(), "the deadline fired during generation, the fleet lock held"
        assert state.name == "Skipped" and state.message.startswith("timed_out: step 51"), state.message
        [row] = JsonlSink(env.jsonl).read(env.run)
        assert (row.step, row.state, row.reason) == (51, "skipped", "timed_out")
        assert row.metrics["eval/skipped_timed_out"] == 1
        assert not Path(src["path"]).exists(), "the timed-out point retired its snapshot"
        with get_client(sync_client=True) as c:
            for name in (fleet.lock_name, inflight_limit_name(env.run)):
                assert c.read_global_concurrency_limit_by_name(name).active_slots == 0, name
        router.release.set()  # the router answers again: the next point of the run is measured
        EvalSuiteBlock(suite=SMALL_SUITE).save(fast := f"{env.blocks['suite']}-fast")
        state = eval_point(**env.params(52, source=_staged(env, 52, tiny_model), max_in_flight=1, suite=fast),
                           return_state=True)
        assert state.name == "Completed", state.message
        measured = [(r.step, r.weight_version) for r in JsonlSink(env.jsonl).read(env.run) if r.state == "measured"]
        assert measured == [(52, "52"), (52, "52")]
    finally:
        router.release.set()
        router.close()
