"""A full disk under the trainer's spool: `dispatch` returns a skipped point with its reason and
never raises into the training loop; once space is back, dispatch spools again.

The disk is a real 256 KiB tmpfs (`small_disk`, root mounts it), filled with a real file until
the kernel answers ENOSPC. The API is a closed port on 127.0.0.1 (nothing is delivered, so the
spool keeps what it wrote).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from pinned_eval.points import SnapshotSource
from tests.conftest import free_port
from trainer_integration.client import EvalClient

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

