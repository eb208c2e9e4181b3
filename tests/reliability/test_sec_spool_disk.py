"""A full disk under the trainer's spool: `dispatch` returns a skipped point with its reason and
never raises into the training loop; once space is back, dispatch spools again.

The disk is a real 256 KiB tmpfs (`small_disk`, root mounts it), filled with a real file until
the kernel answers ENOSPC. The API is a closed port on 127.0.0.1 (nothing is delivered, so the
spool keeps what it wrote).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from pinned_eval.points import SnapshotSource
from pinned_eval.polling import poll_until
from tests.conftest import free_port
from tests.reliability.netfaults import ScriptedServer
from trainer_integration.client import EvalClient
from trainer_integration.spool import Deliverer, RejectedDeliveryError, Spool, SpoolEntry

SOURCE = SnapshotSource(kind="hf", path="/ckpt/step_7", require_marker=False)


def _fill(disk: Path) -> Path:
    """Write a file until the kernel refuses (unbuffered: no write is left for close to fail on)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler


def test_full_spool_disk_is_a_skipped_point_with_its_reason(small_disk: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/api"
    with EvalClient("exp42", dead, spool_dir=small_disk / "spool", startup_sync_s=5, max_in_flight=8) as client:
        filler = _fill(small_disk)
        result = client.dispatch(3, source=SOURCE)
        assert result.action == "skipped_spool_failed"
        assert result.reason == (
            f"[Errno {errno.ENOSPC}] spool {small_disk / 'spool' / 'exp42'}: event for step 3 not written: "
            "No space left on device"
        )
        assert client.spool.pending() == []
        assert list((small_disk / "spool" / "exp42").glob(".tmp-*")) == []  # no half-written entry
        filler.unlink()  # space again: the next point is requested and kept
        assert client.dispatch(4, source=SOURCE).action == "requested"
        assert [e.step for e in client.spool.pending()] == [4]


def test_full_disk_for_export_and_spool_never_reaches_the_training_loop(small_disk: Path) -> None:
    """The in-loop export fails with ENOSPC and its `export_failed` record cannot be spooled either."""

    def export(step: int, dest: str) -> None:
        Path(dest).mkdir(parents=True)
        (Path(dest) / "model.safetensors").write_bytes(b"\0" * (512 << 10))  # larger than the disk

    dead = f"http://127.0.0.1:{free_port()}/api"
    with EvalClient("exp42", dead, spool_dir=small_disk / "spool", staging_root=small_disk / "stage",
                    exporter=export, startup_sync_s=5) as client:
        _fill(small_disk)
        result = client.dispatch(5)
    assert result.action == "skipped_spool_failed"
    assert result.reason is not None and "skip_record for step 5 not written: No space left on device" in result.reason
    assert not (small_disk / "stage" / "exp42" / "step_00000005").exists()  # the partial export removed



def test_delivery_survives_a_full_spool_disk_while_setting_an_entry_aside(small_disk: Path) -> None:
    """A permanent rejection must write the entry to `rejected/`: on a full disk that fails; the
    delivery thread retries it and delivers the rest once space is back, in order."""
    spool = Spool(small_disk / "spool")
    for step in (1, 2):
        spool.append(SpoolEntry(kind="event", run="exp1", step=step, key=f"k{step}", body={"pad": "x" * 2048}))
    delivered: list[int] = []
    refusals: list[int] = []

    def deliver(entry: SpoolEntry) -> None:
        if entry.step == 1:
            refusals.append(1)
            raise RejectedDeliveryError("HTTP 422: refused")
        delivered.append(entry.step)

    filler = _fill(small_disk)
    deliverer = Deliverer(spool, deliver, backoff_s=(0.05, 0.2))
    deliverer.start()
    try:
        # the rejected note cannot be written: the pass fails, and the thread lives to try again
        poll_until(lambda: len(refusals) >= 3, timeout_s=30, interval_s=0.05, what="a third refusal of entry 1")
        assert [e.step for e in spool.pending()] == [1, 2] and delivered == []
        filler.unlink()
        assert deliverer.flush(30)
    finally:
        deliverer.stop()
    assert delivered == [2]
    assert [(e.step, why) for e, why in spool.rejected()] == [(1, "HTTP 422: refused")]


# ---- a full spool disk on every error path of `dispatch` ------------------------------------------


def _spool_full(disk: Path, step: int) -> str:
    return f"spool {disk / 'spool' / 'exp42'}: skip_record for step {step} not written: No space left on device"


def test_full_spool_disk_when_a_point_is_busy_is_a_skipped_point_naming_the_busy_skip(small_disk: Path) -> None:
    """Under `skip` with both slots taken, the `busy` record cannot be spooled: `dispatch` returns
    `skipped_spool_failed` whose reason names the busy skip and the disk; never raises."""
    runs = [{"id": str(s), "name": f"exp42/step-{s}", "parameters": {"run": "exp42", "step": s},
             "state": {"type": "RUNNING", "name": "Running", "message": None},
             "created": "2026-01-01T00:00:00Z"} for s in (1, 2)]
    server = ScriptedServer({
        ("POST", "/api/flow_runs/filter"): lambda body: (200, {"Content-Type": "application/json"},
                                                         json.dumps(runs).encode()),
        ("POST", "/api/events"): lambda body: (503, {}, b""),  # nothing delivered: the spool keeps its entries
    })
    try:
        with EvalClient("exp42", f"{server.url}/api", spool_dir=small_disk / "spool", policy="skip", max_in_flight=2,
                        direct_runs=False, startup_sync_s=30) as client:
            assert client.wait_synced(30)
            filler = _fill(small_disk)
            result = client.dispatch(3, source=SOURCE)
            assert (result.action, result.in_flight, result.admitted_offline) == ("skipped_spool_failed", 0, False)
            assert result.reason == (f"[Errno {errno.ENOSPC}] busy (step 3: 2 points in flight (max 2)) not recorded: "
                                     + _spool_full(small_disk, 3))
            assert client.spool.pending() == []
            filler.unlink()  # space again: the next busy point is recorded
            again = client.dispatch(4, source=SOURCE)
            assert (again.action, again.in_flight) == ("skipped_busy", 2)
            assert [(e.kind, e.step, e.body["state"]["message"]) for e in client.spool.pending()] == [
                ("skip_record", 4, "busy: step 4: 2 points in flight (max 2)")]
    finally:
        server.close()


def test_full_spool_disk_after_an_exporters_own_error_names_the_export_failure(
    small_disk: Path, tmp_path: Path
) -> None:
    def buggy(step: int, dest: str) -> None:
        Path(dest).mkdir(parents=True)
        raise ValueError("shape mismatch")

    dead = f"http://127.0.0.1:{free_port()}/api"
    with EvalClient("exp42", dead, spool_dir=small_disk / "spool", staging_root=tmp_path / "stage",
                    startup_sync_s=5) as client:
        _fill(small_disk)
        result = client.dispatch(5, export=buggy)
    assert result.action == "skipped_spool_failed"
    assert result.reason == (f"[Errno {errno.ENOSPC}] export_failed (step 5: in-loop export: "
                             f"ValueError('shape mismatch')) not recorded: " + _spool_full(small_disk, 5))
    assert not (tmp_path / "stage" / "exp42" / "step_00000005").exists()  # the partial export removed


def test_full_spool_disk_after_a_storage_error_is_an_export_failed_point_naming_both(
    small_disk: Path, tmp_path: Path
) -> None:
    """A staging root another user could redirect (a symlink) is refused: `export_failed`; its record
    cannot be spooled either: both errors in `reason`, and the exporter never ran."""
    (tmp_path / "real").mkdir()
    (tmp_path / "stage").symlink_to(tmp_path / "real")
    exported: list[int] = []
    dead = f"http://127.0.0.1:{free_port()}/api"
    with EvalClient("exp42", dead, spool_dir=small_disk / "spool", staging_root=tmp_path / "stage",
                    startup_sync_s=5) as client:
        _fill(small_disk)
        result = client.dispatch(6, export=lambda step, dest: exported.append(step))
    refused = f"staging root {str(tmp_path / 'stage')!r} refused: it is a symlink (to {str(tmp_path / 'real')!r})"
    assert result.action == "skipped_export_failed" and exported == []
    assert result.reason == (f"dispatch error: UnsafeStagingRootError({refused!r}); not recorded: "
                             f"[Errno {errno.ENOSPC}] export_failed (step 6: dispatch error (see trainer log)) "
                             "not recorded: "
                             + _spool_full(small_disk, 6))
