"""Two-phase in-loop export through `EvalClient.dispatch` (no Prefect server: a closed port, so
every request lands in the real spool on disk): the loop waits for the copy into the host buffer,
the snapshot is written in the background, the point is requested only after its marker."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pinned_eval.points import SnapshotSource
from pinned_eval.snapshot.check import check_snapshot
from pinned_eval.snapshot.host_staging import HostStaging, StagingBusyError
from pinned_eval.snapshot.layout import MARKER
from pinned_eval.snapshot.two_phase import LoraExport, StagedTensors, StateDictExport
from tests.conftest import free_port
from trainer_integration.client import EvalClient
from trainer_integration.spool import Spool

pytestmark = pytest.mark.timeout(60)
WAIT_S = 30


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


class Recording(HostStaging):
    """The CUDA path's shape with recording allocation/copy/synchronise (no GPU here)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        super().__init__(pinned=True, alloc=self._rec_alloc, copy=self._rec_copy, synchronize=self._rec_sync)

    def _rec_alloc(self, nbytes: int) -> torch.Tensor:
        self.calls.append(("alloc", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def _rec_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.calls.append(("copy", tuple(src.shape)))
        dst.copy_(src)

    def _rec_sync(self) -> None:
        self.calls.append(("sync", None))

    def acquire(self, *, wait: bool, timeout: float | None = None) -> bool:
        self.calls.append(("acquire", wait))
        return super().acquire(wait=wait, timeout=timeout)


class Gated:
    """A two-phase exporter whose background write blocks on an Event (then writes for real)."""

    def __init__(self, inner: StateDictExport, fail: BaseException | None = None) -> None:
        self.inner, self.fail = inner, fail
        self.entered, self.release = threading.Event(), threading.Event()
        self.log: list[str] = []

    def stage(self, step: int, pool: HostStaging) -> Any:
        self.log.append(f"stage {step}")
        staged = self.inner.stage(step, pool)
        gate = self

        class _Staged:
            def write(self, dest: str, storage_options: dict[str, Any] | None = None) -> object:
                gate.entered.set()
                assert gate.release.wait(WAIT_S)
                if gate.fail is not None:
                    Path(dest).mkdir(parents=True, exist_ok=True)
                    (Path(dest) / "model-00001-of-00002.safetensors").write_bytes(b"partial")
                    raise gate.fail
                out = staged.write(dest, storage_options)
                gate.log.append(f"written {step}")
                return out

        return _Staged()


@pytest.fixture
def make_client(tmp_path: Path) -> Iterator[Any]:
    clients: list[EvalClient] = []

    def make(**kw: Any) -> EvalClient:
        kw.setdefault("spool_dir", tmp_path / "spool")
        kw.setdefault("staging_root", tmp_path / "staging")
        c = EvalClient("exp42", f"http://127.0.0.1:{free_port()}/api", startup_sync_s=0, **kw)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


def _entries(tmp_path: Path) -> list[tuple[str, int]]:
    return [(e.kind, e.step) for e in Spool(tmp_path / "spool" / "exp42").pending()]


def test_dispatch_returns_before_the_blocked_write_and_requests_only_after_the_marker(tmp_path, make_client):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exporter = Gated(StateDictExport(model))
    client = make_client()
    marker_at_request: list[bool] = []
    enqueue = client._enqueue

    def recording_enqueue(entry: Any) -> None:  # what the disk held when the request was spooled
        dest = tmp_path / "staging" / "exp42" / f"step_{entry.step:08d}"
        marker_at_request.append((dest / MARKER).exists())
        enqueue(entry)

    client._enqueue = recording_enqueue  # type: ignore[method-assign]
    result = client.dispatch(3, export=exporter)
    assert (result.action, result.step) == ("exporting", 3)
    assert result.export_time_seconds is not None
    assert exporter.entered.wait(WAIT_S)  # the write has started and is blocked
    dest = tmp_path / "staging" / "exp42" / "step_00000003"
    assert not (dest / MARKER).exists() and _entries(tmp_path) == []  # nothing requested yet
    assert client.dispatch(3, export=exporter).action == "exists"  # the step being written
    assert 3 in client._spooled()  # admission counts it in flight
    with torch.no_grad():  # the loop goes on training: the staged copy is what gets written
        for p in model.parameters():
            p.add_(1.0)
    exporter.release.set()
    assert client.wait_exports(WAIT_S)
    assert _entries(tmp_path) == [("event", 3)] and marker_at_request == [True]
    [entry] = Spool(tmp_path / "spool" / "exp42").pending()
    assert SnapshotSource.model_validate(entry.body["payload"]["source"]).path == str(dest)
    assert check_snapshot(str(dest)).complete
    got = {k: v for f in sorted(dest.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert set(got) == set(before) and all(torch.equal(got[k], before[k]) for k in before)
    assert not client.host_staging.busy  # the lease is handed back after the write


def test_a_failing_background_write_is_that_steps_export_failed_with_nothing_left(tmp_path, make_client):
    client = make_client()
    bad = Gated(StateDictExport(_model()), fail=OSError(28, "No space left on device"))
    bad.release.set()
    assert client.dispatch(3, export=bad).action == "exporting"  # never raised into the loop
    assert client.wait_exports(WAIT_S)
    assert not (tmp_path / "staging" / "exp42" / "step_00000003").exists()  # partial output removed
    ok = client.dispatch(4, export=StateDictExport(_model()))
    assert ok.action == "exporting" and client.wait_exports(WAIT_S)
    entries = Spool(tmp_path / "spool" / "exp42").pending()
    assert [(e.kind, e.step) for e in entries] == [("skip_record", 3), ("event", 4)]
    assert entries[0].body["state"]["message"] == (
        "export_failed: step 3: in-loop export (background write): OSError(28, 'No space left on device')"
    )


def test_an_export_during_a_write_is_skipped_under_skip_without_allocating(tmp_path, make_client):
    pool = Recording()
    client = make_client(policy="skip", host_staging=pool)
    first = Gated(StateDictExport(_model()))
    assert client.dispatch(3, export=first).action == "exporting"
    assert first.entered.wait(WAIT_S)
    second = StateDictExport(_model())
    busy = client.dispatch(5, export=second)
    assert (busy.action, busy.reason) == ("skipped_export_busy", "the previous in-loop snapshot is still being written")
    assert [c for c in pool.calls if c[0] == "alloc"] == [("alloc", 256)]  # 4 tensors, each 64-byte aligned: one buffer
    first.release.set()
    assert client.wait_exports(WAIT_S)
    entries = Spool(tmp_path / "spool" / "exp42").pending()
    assert [(e.kind, e.step) for e in entries] == [("skip_record", 5), ("event", 3)]
    assert entries[0].body["state"]["message"] == (
        "export_busy: step 5: the previous in-loop snapshot is still being written"
    )


def test_an_export_during_a_write_waits_under_backpressure_then_reuses_the_buffer(tmp_path, make_client):
    pool = Recording()
    client = make_client(policy="backpressure", host_staging=pool)
    first = Gated(StateDictExport(_model()))
    assert client.dispatch(3, export=first).action == "exporting"
    assert first.entered.wait(WAIT_S)
    second = Gated(StateDictExport(_model()))
    second.release.set()
    waiting = threading.Event()
    acquire = pool.acquire

    def noting_acquire(*, wait: bool, timeout: float | None = None) -> bool:
        waiting.set()
        return acquire(wait=wait, timeout=timeout)

    pool.acquire = noting_acquire  # type: ignore[method-assign]
    results: list[Any] = []
    t = threading.Thread(target=lambda: results.append(client.dispatch(5, export=second)))
    t.start()
    assert waiting.wait(WAIT_S)  # the second dispatch is at the lease
    first.log.append("released")
    first.release.set()
    t.join(WAIT_S)
    assert [r.action for r in results] == ["exporting"]
    assert client.wait_exports(WAIT_S)
    assert first.log == ["stage 3", "released", "written 3"] and second.log == ["stage 5", "written 5"]
    assert _entries(tmp_path) == [("event", 3), ("event", 5)]
    assert pool.allocations == 1 and [c[0] for c in pool.calls].count("alloc") == 1


def test_staging_buffers_are_allocated_once_and_reused_for_every_export(tmp_path, make_client):
    pool = Recording()
    client = make_client(host_staging=pool)
    model = _model()
    for step in (1, 2, 3, 4):
        assert client.dispatch(step, export=StateDictExport(model)).action == "exporting"
        assert client.wait_exports(WAIT_S)
    assert pool.allocations == 1 and pool.capacity_bytes == 256
    kinds = [c[0] for c in pool.calls]
    assert kinds == ["acquire", "alloc", *(["copy"] * 4), "sync"] + (["acquire", *(["copy"] * 4), "sync"]) * 3
    assert _entries(tmp_path) == [("event", s) for s in (1, 2, 3, 4)]


def test_host_staging_bounds_memory_to_the_largest_snapshot_and_needs_its_lease():
    pool = HostStaging(pinned=False)
    with pytest.raises(StagingBusyError, match="lease is not held"):
        pool.stage([("w", torch.ones(2))])
    assert pool.acquire(wait=False)
    assert not pool.acquire(wait=False)  # held: a second export never gets a second buffer
    small = pool.stage([("w", torch.ones(2, 3))], {"w": torch.bfloat16})
    assert small["w"].dtype == torch.bfloat16 and torch.equal(small["w"], torch.ones(2, 3, dtype=torch.bfloat16))
    assert (pool.allocations, pool.capacity_bytes) == (1, 64)
    pool.stage([("a", torch.ones(40)), ("b", torch.zeros(3))])  # 160 + 12 bytes -> 192 + 64
    assert (pool.allocations, pool.capacity_bytes) == (2, 256)
    pool.stage([("w", torch.ones(2, 3))])
    assert (pool.allocations, pool.capacity_bytes) == (2, 256)  # smaller again: reused
    pool.release()
    assert not pool.busy


def test_a_user_callable_keeps_the_synchronous_contract(tmp_path, make_client):
    client = make_client()
    seen: list[bool] = []

    def export(step: int, dest: str) -> None:
        StagedTensors({"w": torch.ones(2)}, None, 1 << 20).write(dest)
        seen.append(True)

    result = client.dispatch(2, export=export)
    assert (result.action, seen, _entries(tmp_path)) == ("requested", [True], [("event", 2)])


def test_lora_two_phase_export_is_a_complete_adapter_dispatched_as_lora(tmp_path, make_client):
    from safetensors import safe_open

    from engine.tiny_model import make_tiny_adapter, make_tiny_model

    base = make_tiny_model(tmp_path / "base")
    adapter = make_tiny_adapter(base, tmp_path / "adapter")
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    import json

    config = json.loads((adapter / "adapter_config.json").read_text())
    client = make_client(lora_base=base)
    assert client.dispatch(7, export=LoraExport(tensors, config)).action == "exporting"
    assert client.wait_exports(WAIT_S)
    [entry] = Spool(tmp_path / "spool" / "exp42").pending()
    source = SnapshotSource.model_validate(entry.body["payload"]["source"])
    assert (source.kind, source.hf_base) == ("lora", str(base))
    assert check_snapshot(source.path).complete
    got = load_file(str(Path(source.path) / "adapter_model.safetensors"))
    assert set(got) == set(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)

    # the same adapter read from a live PEFT model: same tensors, same rank, a complete snapshot
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter))
    assert client.dispatch(8, export=LoraExport.from_peft(peft_model)).action == "exporting"
    assert client.wait_exports(WAIT_S)
    dest = tmp_path / "staging" / "exp42" / "step_00000008"
    assert check_snapshot(str(dest)).complete
    from_peft = load_file(str(dest / "adapter_model.safetensors"))
    assert set(from_peft) == set(tensors) and all(torch.equal(from_peft[k], tensors[k]) for k in tensors)
    assert json.loads((dest / "adapter_config.json").read_text())["r"] == config["r"]


_CRASH_CHILD = """
import sys
from pathlib import Path
import torch
from pinned_eval.snapshot.host_staging import HostStaging
from pinned_eval.snapshot.two_phase import StateDictExport

dest, mid = sys.argv[1], Path(sys.argv[2])
pool = HostStaging(pinned=False)
pool.acquire(wait=False)
staged = StateDictExport({f"w{i}": torch.full((64,), float(i)) for i in range(4)}, max_shard_bytes=256).stage(1, pool)

class Stalling(dict):
    def items(self):  # two shards' tensors, then the write stops mid-snapshot until it is killed
        for i, (name, t) in enumerate(dict.items(self)):
            if i == 2:
                mid.write_text("mid-write")
                sys.stdin.read()
            yield name, t

object.__setattr__(staged, "tensors", Stalling(staged.tensors))
staged.write(dest)
"""


def test_a_crash_mid_write_leaves_no_snapshot_that_checks_complete(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    from pinned_eval.polling import poll_until

    dest, mid = tmp_path / "step_00000001", tmp_path / "mid"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, str(dest), str(mid)], stdin=subprocess.PIPE, env=env)
    try:
        poll_until(lambda: mid.exists() or child.poll() is not None or None, timeout_s=WAIT_S, what="mid-write")
        assert child.poll() is None, "the writer ended before it was killed"
        assert sorted(p.name for p in dest.iterdir()) == [  # two of four shards written
            "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
        ]
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(WAIT_S) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(WAIT_S)
    assert not (dest / MARKER).exists()
    check = check_snapshot(str(dest))
    assert (check.complete, check.problem) == (False, "missing_marker")


def test_a_collectives_staged_snapshot_is_written_by_the_client_or_its_buffer_handed_back(tmp_path, make_client):
    from pinned_eval.snapshot.collective_staged import StagedCollective

    client = make_client(eval_interval=2)
    pool = client.host_staging

    def staged() -> StagedCollective:  # what collective_stage returns on rank 0 (lease held)
        assert pool.acquire(wait=False)
        views = pool.stage([("w", torch.arange(4.0))])
        return StagedCollective(ok=True, rank=0, tensors=views, pool=pool)

    assert client.dispatch(2, export=staged()).action == "not_due"  # (2 + 1) % 2 != 0
    assert not pool.busy  # handed back, never leaked
    assert client.dispatch(3, export=staged()).action == "exporting"
    assert client.wait_exports(WAIT_S) and not pool.busy
    busy = client.dispatch(5, export=StagedCollective(ok=False, rank=0, skipped="export_busy"))
    failed = client.dispatch(7, export=StagedCollective(ok=False, rank=0, error="rank 0 failed: OSError: disk"))
    assert (busy.action, failed.action) == ("skipped_export_busy", "skipped_export_failed")
    entries = Spool(tmp_path / "spool" / "exp42").pending()
    assert [(e.kind, e.step) for e in entries] == [("event", 3), ("skip_record", 5), ("skip_record", 7)]
    assert entries[2].body["state"]["message"] == "export_failed: step 7: in-loop export: rank 0 failed: OSError: disk"
    [shard] = (tmp_path / "staging" / "exp42" / "step_00000003").glob("*.safetensors")
    assert torch.equal(load_file(str(shard))["w"], torch.arange(4.0))


def test_close_finishes_the_background_write_and_spools_its_request(tmp_path):
    client = EvalClient("exp42", f"http://127.0.0.1:{free_port()}/api", startup_sync_s=0,
                        spool_dir=tmp_path / "spool", staging_root=tmp_path / "staging")
    exporter = Gated(StateDictExport(_model()))
    assert client.dispatch(3, export=exporter).action == "exporting"
    waiting = threading.Event()
    wait = client._writes.wait

    def noting_wait(timeout: float | None = None) -> bool:
        exporter.log.append("close waits")
        waiting.set()
        return wait(timeout)

    client._writes.wait = noting_wait  # type: ignore[method-assign]
    closer = threading.Thread(target=lambda: (client.close(), exporter.log.append("closed")))
    closer.start()
    assert waiting.wait(WAIT_S)
    exporter.release.set()
    closer.join(WAIT_S)
    assert exporter.log == ["stage 3", "close waits", "written 3", "closed"]
    assert _entries(tmp_path) == [("event", 3)]


def test_reserve_allocates_ahead_so_the_first_export_only_copies():
    pool = Recording()
    pool.reserve(256).join(WAIT_S)
    assert (pool.allocations, pool.capacity_bytes, pool.busy) == (1, 256, False)
    assert pool.acquire(wait=False)
    pool.stage(_model().state_dict().items())
    assert [c[0] for c in pool.calls] == ["acquire", "alloc", "acquire", "copy", "copy", "copy", "copy", "sync"]
    assert pool.allocations == 1


def test_state_dict_export_casts_while_staging_so_the_buffer_is_the_written_size(tmp_path):
    pool = HostStaging(pinned=False)
    assert pool.acquire(wait=False)
    model = _model()
    model.register_buffer("count", torch.tensor([7], dtype=torch.int64))  # not floating: kept as is
    staged = StateDictExport(model, dtype=torch.bfloat16, metadata=lambda step: {"at": step * 10}).stage(4, pool)
    assert {k: v.dtype for k, v in staged.tensors.items()} == {
        "0.weight": torch.bfloat16, "0.bias": torch.bfloat16, "1.weight": torch.bfloat16, "1.bias": torch.bfloat16,
        "count": torch.int64,
    }
    assert pool.capacity_bytes == 5 * 64  # every tensor fits one 64-byte slot in bf16
    staged.write(str(tmp_path / "snap"))
    [shard] = (tmp_path / "snap").glob("*.safetensors")
    got = load_file(str(shard))
    assert torch.equal(got["0.weight"], model.state_dict()["0.weight"].to(torch.bfloat16))
    assert staged.metadata == {"at": 40, "step": 4}


def test_a_snapshot_being_written_counts_in_flight_for_admission():
    """The client's `_spooled()` holds the step being written (asserted above); admission counts it."""
    from trainer_integration.admission import AdmissionView

    view = AdmissionView("exp42", visible_timeout_s=60)
    view.refresh([], set())  # a fresh, empty server view
    verdict, n, _, offline = view.decide(5, final=False, policy="skip", max_in_flight=1, spooled=lambda: {3},
                                         poll_s=0.01, wake=lambda: None)
    assert (verdict, n, offline) == ("busy", 1, False)
    verdict, n, _, _ = view.decide(5, final=False, policy="skip", max_in_flight=1, spooled=set,
                                   poll_s=0.01, wake=lambda: None)
    assert (verdict, n) == ("ok", 0)
