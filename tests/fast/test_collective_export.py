"""Collective export on a real 2-process gloo group (no megatron): TP shards gathered and merged,
rank 0 writes, and a failure on rank 0 ends every rank with a clear result instead of a hang.

One spawned job runs every scenario in sequence and records what each rank saw; the tests assert
on those records. The job has a hard deadline and its processes are killed by PID on overrun.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from pinned_eval.snapshot.collective import CollectiveExportError, collective_export, merge_partitions
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(120)
JOB_DEADLINE_S = 90


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "col.weight": torch.randn(8, 6, generator=g),  # column-parallel: partition_dim 0
        "row.weight": torch.randn(6, 8, generator=g),  # row-parallel: partition_dim 1
        "glu.weight": torch.randn(16, 6, generator=g),  # [gate; up], partition_stride 2
        "norm.weight": torch.randn(6, generator=g),  # replicated
    }


_TP = {"col.weight": (0, 1), "row.weight": (1, 1), "glu.weight": (0, 2)}


def _local(rank: int, world: int) -> list[tuple[str, torch.nn.Parameter]]:
    """What rank `rank` holds: Megatron's (strided) partitioning of the full tensors."""
    out = []
    for name, t in _full().items():
        if name in _TP:
            dim, stride = _TP[name]
            chunks = t.chunk(world * stride, dim=dim)
            p = torch.nn.Parameter(torch.cat([chunks[k * world + rank] for k in range(stride)], dim=dim))
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
        else:
            p = torch.nn.Parameter(t.clone())
        out.append((name, p))
    return out


def _run(rank: int, world: int, tp_group: dist.ProcessGroup, root: Path, name: str, **kw) -> dict:
    tensors = kw.pop("tensors", None) or _local(rank, world)
    try:
        res = collective_export(lambda: tensors, str(root / name), tp_group=tp_group, **kw)
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"ok": res.ok, "error": res.error, "path": res.path, "bytes": res.bytes, "rank": res.rank}


def _job(rank: int, world: int, port: int, root_s: str) -> None:
    import os

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    root = Path(root_s)
    tp = dist.new_group(list(range(world)))
    seen: dict[str, dict] = {}
    try:
        # 1. success, several buckets (bucket smaller than one tensor), several shards
        seen["ok"] = _run(rank, world, tp, root, "ok", bucket_bytes=64, max_shard_bytes=256)

        # 2. converter fails on rank 0 in the middle of the stream
        def boom(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
            if name == "glu.weight":
                raise RuntimeError("converter exploded on glu.weight")
            return [(name, t)]

        seen["convert_fails"] = _run(rank, world, tp, root, "convert_fails", converter=boom, bucket_bytes=64)

        # 3. storage fails on rank 0 before the first tensor is pulled (dest under a regular file)
        (root / "a_file").write_text("x")
        seen["storage_fails"] = _run(rank, world, tp, root, "a_file/snap")

        # 4. the plan (built on rank 0 from full shapes) rejects a tensor
        def bad_plan(full):
            from pinned_eval.snapshot.writer import TensorSpec

            return [TensorSpec(n, s, d) for n, s, d in full if n != "row.weight"]

        seen["plan_fails"] = _run(rank, world, tp, root, "plan_fails", plan=bad_plan)

        # 5. the ranks disagree on the tensors: every rank fails at once
        tensors = _local(rank, world)
        if rank == 1:
            tensors = tensors[:-1]
        seen["mismatch"] = _run(rank, world, tp, root, "mismatch", tensors=tensors)

        # 6. still usable after all that: a second success on the same group
        seen["again"] = _run(rank, world, tp, root, "again")
        (root / f"seen-{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("collective")
    args = (2, free_port(), str(root))
    ctx = mp.start_processes(_job, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + JOB_DEADLINE_S
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                pytest.fail(f"collective export job hung for {JOB_DEADLINE_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    seen = [json.loads((root / f"seen-{r}.json").read_text()) for r in (0, 1)]
    return {"root": root, **{k: [seen[0][k], seen[1][k]] for k in seen[0]}}


def test_gathers_tp_shards_and_rank0_writes(job: dict) -> None:
    r0, r1 = job["ok"]
    assert r0["ok"] and r1["ok"] and r0["rank"] == 0 and r1["rank"] == 1
    assert r0["path"] == r1["path"] == str(job["root"] / "ok") and r0["bytes"] == r1["bytes"] > 0
    snap = job["root"] / "ok"
    assert (snap / ".complete").is_file()
    index = json.loads((snap / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    got = {k: v for s in shards for k, v in load_file(snap / s).items()}
    full = _full()
    assert got.keys() == full.keys()
    for name, t in full.items():
        assert torch.equal(got[name], t), name


def test_rank0_converter_failure_does_not_hang_other_rank(job: dict) -> None:
    r0, r1 = job["convert_fails"]
    assert r0 == {"raised": "RuntimeError", "message": "converter exploded on glu.weight"}
    assert r1["ok"] is False and "converter exploded on glu.weight" in r1["error"]
    assert r1["error"].startswith("rank 0 failed")
    assert not (job["root"] / "convert_fails" / ".complete").exists()


def test_rank0_storage_failure_before_first_tensor(job: dict) -> None:
    r0, r1 = job["storage_fails"]
    assert "raised" in r0
    assert r1["ok"] is False and r0["raised"] in r1["error"]


def test_plan_failure_on_rank0(job: dict) -> None:
    r0, r1 = job["plan_fails"]
    assert r0["raised"] == "SnapshotWriteError" and "row.weight" in r0["message"]
    assert r1["ok"] is False and "row.weight" in r1["error"]
    assert not (job["root"] / "plan_fails" / ".complete").exists()


def test_rank_disagreement_fails_every_rank(job: dict) -> None:
    for seen in job["mismatch"]:
        assert seen["raised"] == CollectiveExportError.__name__
        assert "#3" in seen["message"]
    assert not (job["root"] / "mismatch").exists()


def test_group_stays_usable_after_failures(job: dict) -> None:
    assert [r["ok"] for r in job["again"]] == [True, True]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_merge_partitions_inverts_strided_partitioning(world: int) -> None:
    full = _full()
    for name, (dim, stride) in _TP.items():
        shards = [_local(r, world)[list(full).index(name)][1].detach() for r in range(world)]
        assert torch.equal(merge_partitions(name, shards, dim, stride), full[name])
    naive = torch.cat([_local(r, 2)[2][1].detach() for r in range(2)])
    assert not torch.equal(naive, full["glu.weight"])  # the regrouping is needed


def test_requires_process_group() -> None:
    with pytest.raises(RuntimeError, match="process group"):
        collective_export(lambda: [], "unused")
