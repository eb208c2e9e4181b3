"""Two-phase collective export on a real 2-process gloo group: every rank's part is off the
device when `collective_stage` returns (the ranks then overwrite their tensors), rank 0 writes
from its host buffer afterwards; busy buffer -> every rank skips; a rank-0 failure never hangs.

One spawned job runs the scenarios in order and records what each rank saw; the job has a hard
deadline and its processes are killed by PID on overrun (as in test_collective_export.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from pinned_eval.snapshot.check import check_snapshot
from tests.conftest import free_port
from tests.fast.test_collective_export import _full, _local

pytestmark = pytest.mark.timeout(120)
JOB_DEADLINE_S = 90


def _job(rank: int, world: int, port: int, root_s: str) -> None:
    import os

    from pinned_eval.snapshot.collective_staged import collective_stage
    from pinned_eval.snapshot.host_staging import HostStaging

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    root = Path(root_s)
    tp = dist.new_group(list(range(world)))
    pool = HostStaging(pinned=False) if rank == 0 else None
    seen: dict[str, object] = {}
    try:
        tensors = _local(rank, world)
        first = collective_stage(lambda: tensors, pool=pool, tp_group=tp, bucket_bytes=64, max_shard_bytes=256)
        with torch.no_grad():  # training goes on at once: the staged copy must not see this
            for _, p in tensors:
                p.add_(100.0)
        seen["first"] = {"ok": first.ok, "rank": first.rank, "skipped": first.skipped}
        # the buffer is still held (not written yet): a non-waiting export skips on every rank
        busy = collective_stage(lambda: tensors, pool=pool, wait=False, tp_group=tp)
        seen["busy"] = {"ok": busy.ok, "skipped": busy.skipped, "error": busy.error}
        if rank == 0:
            first.write(str(root / "first"))
            first.discard()
            assert pool is not None
            seen["allocations_after_first"] = pool.allocations
            # phase 2 fails on rank 0 alone (dest under a regular file): no collective involved
            again = collective_stage(lambda: tensors, pool=pool, tp_group=tp)
            (root / "a_file").write_text("x")
            try:
                again.write(str(root / "a_file" / "snap"))
                seen["write_fails"] = "wrote"
            except Exception as exc:
                seen["write_fails"] = type(exc).__name__
            again.discard()
        else:
            again = collective_stage(lambda: tensors, pool=pool, tp_group=tp)
            seen["write_fails"] = {"ok": again.ok}

        # rank 0 fails while staging (its merge raises): rank 0 raises, the other returns
        def bad_merge(name: str, parts: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
            raise RuntimeError(f"merge exploded on {name}")

        try:
            failed = collective_stage(lambda: tensors, pool=pool, tp_group=tp, merge=bad_merge)
            seen["stage_fails"] = {"ok": failed.ok, "error": failed.error}
        except RuntimeError as exc:
            seen["stage_fails"] = {"raised": str(exc), "lease_free": pool is not None and not pool.busy}
        last = collective_stage(lambda: tensors, pool=pool, tp_group=tp)
        if rank == 0:
            last.write(str(root / "last"))
            last.discard()
            assert pool is not None
            seen["allocations"] = pool.allocations
        seen["last"] = last.ok
        (root / f"seen-{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("staged")
    ctx = mp.start_processes(_job, args=(2, free_port(), str(root)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + JOB_DEADLINE_S
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                pytest.fail(f"staged collective job hung for {JOB_DEADLINE_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    seen = [json.loads((root / f"seen-{r}.json").read_text()) for r in (0, 1)]
    return {"root": root, "seen": seen}


def _snapshot(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return {k: v for s in set(index["weight_map"].values()) for k, v in load_file(path / s).items()}


def test_every_ranks_part_is_off_the_device_when_the_stage_returns(job: dict) -> None:
    r0, r1 = job["seen"]
    assert r0["first"] == {"ok": True, "rank": 0, "skipped": None}
    assert r1["first"] == {"ok": True, "rank": 1, "skipped": None}
    got = _snapshot(job["root"] / "first")  # written after both ranks overwrote their tensors
    full = _full()
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
    assert check_snapshot(str(job["root"] / "first")).complete


def test_a_busy_buffer_skips_on_every_rank_without_allocating(job: dict) -> None:
    r0, r1 = job["seen"]
    assert r0["busy"] == r1["busy"] == {"ok": False, "skipped": "export_busy", "error": None}
    assert r0["allocations_after_first"] == 1


def test_a_failed_background_write_is_rank0s_alone_and_leaves_no_snapshot(job: dict) -> None:
    r0, r1 = job["seen"]
    assert r0["write_fails"] == "ExportPathError" and r1["write_fails"] == {"ok": True}
    assert not (job["root"] / "a_file" / "snap").exists()


def test_a_rank0_staging_failure_never_hangs_the_others_and_frees_the_buffer(job: dict) -> None:
    r0, r1 = job["seen"]
    assert r0["stage_fails"] == {"raised": "merge exploded on col.weight", "lease_free": True}
    assert r1["stage_fails"] == {"ok": False, "error": "rank 0 failed: RuntimeError: merge exploded on col.weight"}
    assert r0["last"] is True and r1["last"] is True
    assert r0["allocations"] == 1  # one buffer for every export of the job
    got = _snapshot(job["root"] / "last")
    full = _full()
    assert all(torch.equal(got[k], full[k] + 100.0) for k in full)
