"""Storage faults: an S3 endpoint that errors or drops connections, and a full local disk.

S3 faults come from `FaultyHTTPProxy` in front of moto (real S3 protocol, real s3fs/botocore
retries). A full disk is a 256 KiB tmpfs (or RLIMIT_FSIZE in a subprocess where mounting is not
allowed). Guarantee: transient faults are retried with backoff and the export succeeds;
persistent ones end the point as `export_failed` with nothing partial left in staging, and the
training loop never sees an exception.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import s3fs
import torch
from safetensors.torch import load_file, save_file

from blocks import FleetBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.events import BlockNames
from pinned_eval.sinks import JsonlSink
from pinned_eval.snapshot.check import check_snapshot
from pinned_eval.snapshot.staging import Staging
from pinned_eval.snapshot.writer import write_snapshot
from tests.conftest import free_port
from tests.pointkit import save_point_blocks
from tests.reliability.netfaults import FaultyHTTPProxy, Rule
from tests.s3_fixtures import KEY, SECRET, S3Server
from tests.snapshot_fixtures import named_tensors
from trainer_integration.client import EvalClient

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _opts(endpoint: str) -> dict[str, str]:
    return {"key": KEY, "secret": SECRET, "endpoint_url": endpoint}


def _left(server: S3Server, url: str) -> list[str]:
    return s3fs.S3FileSystem(**server.storage_options, skip_instance_cache=True).find(url)


@pytest.mark.parametrize("action", ["error", "drop"])
def test_transient_s3_faults_are_retried_and_the_snapshot_is_complete(s3_server: S3Server, action: str) -> None:
    bucket = s3_server.make_bucket("rel")
    proxy = FaultyHTTPProxy(
        s3_server.endpoint_url, [Rule(action, methods=("PUT",), path_contains="index.json", times=2)]
    )
    try:
        url = f"s3://{bucket}/stage/exp1/step_00000001"
        write_snapshot(named_tensors(), url, storage_options=_opts(proxy.url))
        assert len(proxy.seen(action, "index.json")) == 2, "both faults were hit"
        assert len(proxy.seen("pass", "index.json")) == 1, "and the third try went through"
    finally:
        proxy.close()
    assert check_snapshot(url, s3_server.storage_options).complete


def test_persistent_s3_errors_end_the_point_export_failed_with_nothing_left(
    prefect_server: str, s3_server: S3Server, tmp_path: Path, tiny_model: Path
) -> None:
    bucket = s3_server.make_bucket("rel")
    proxy = FaultyHTTPProxy(s3_server.endpoint_url, [Rule("error", methods=("PUT",), path_contains="index.json")])
    try:
        dead = [f"http://127.0.0.1:{free_port()}"]
        env = save_point_blocks(
            tmp_path, FleetBlock(name="s3faults", mode="attach", engine_urls=dead, router_url=dead[0])
        )
        StagingBlock(
            root=f"s3://{bucket}/stage",
            endpoint_url=proxy.url,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            cache_dir=str(tmp_path / "cache"),
            source_roots=[str(tmp_path), str(tiny_model)],
        ).save(env.blocks["staging"], overwrite=True)
        weights = tmp_path / "step5.safetensors"
        save_file({k: v for f in tiny_model.glob("*.safetensors") for k, v in load_file(f).items()}, str(weights))
        state = eval_point(
            **env.params(5, source={"kind": "state_dict", "path": str(weights), "hf_base": str(tiny_model)}),
            return_state=True,
        )
        retried = len(proxy.seen("error", "index.json"))
    finally:
        proxy.close()
    assert state.name == "Skipped" and state.message.startswith("export_failed"), state.message
    assert retried >= 3, f"the upload was retried before giving up ({retried} tries)"
    assert _left(s3_server, f"s3://{bucket}/stage/{env.run}") == [], "the uploaded shard was removed"
    [row] = JsonlSink(env.jsonl).read(env.run)
    assert row.step == 5 and row.metrics["eval/skipped_export_failed"] == 1


def test_full_local_staging_is_export_failed_and_leaves_nothing(
    prefect_server: str, small_disk: Path, tmp_path: Path, tiny_model: Path
) -> None:
    dead = [f"http://127.0.0.1:{free_port()}"]
    env = save_point_blocks(tmp_path, FleetBlock(name="diskfull", mode="attach", engine_urls=dead, router_url=dead[0]))
    StagingBlock(root=str(small_disk / "stage"), source_roots=[str(tmp_path), str(tiny_model)]).save(
        env.blocks["staging"], overwrite=True
    )
    weights = tmp_path / "step6.safetensors"
    save_file({k: v for f in tiny_model.glob("*.safetensors") for k, v in load_file(f).items()}, str(weights))
    assert weights.stat().st_size > 300 * 1024, "the snapshot must not fit the 256 KiB disk"
    state = eval_point(
        **env.params(6, source={"kind": "state_dict", "path": str(weights), "hf_base": str(tiny_model)}),
        return_state=True,
    )
    assert state.name == "Skipped" and state.message.startswith("export_failed"), state.message
    assert not (small_disk / "stage" / env.run / "step_00000006").exists()


def test_full_disk_in_loop_export_never_reaches_the_training_loop(
    prefect_server: str, small_disk: Path, tmp_path: Path, tiny_model: Path
) -> None:
    """The trainer's own in-loop export hits ENOSPC: a skip record, no exception, no partial files."""
    big = [(f"w{i}", torch.randn(256, 256)) for i in range(2)]  # 512 KiB > the 256 KiB disk

    def export(step: int, dest: str) -> None:
        write_snapshot(big, dest, base_hf_dir=str(tiny_model))

    run = f"r{uuid.uuid4().hex[:8]}"
    with EvalClient(
        run,
        prefect_server,
        blocks=BlockNames(),
        staging_root=small_disk / "stage",
        exporter=export,
        spool_dir=tmp_path / "spool",
        max_in_flight=4,
    ) as client:
        result = client.dispatch(3)
        next_step = client.dispatch(4)  # the loop goes on; this one fails the same way, quietly
    assert result.action == "skipped_export_failed" and next_step.action == "skipped_export_failed"
    assert list((small_disk / "stage").rglob("*.safetensors")) == []
    assert not (small_disk / "stage" / run / "step_00000003").exists()


_FSIZE_CHILD = """
import resource, signal, sys
from pinned_eval.snapshot.staging import Staging
from pinned_eval.snapshot.writer import write_snapshot
from tests.snapshot_fixtures import named_tensors
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
dest = Staging(sys.argv[1]).path_for("exp1", 1)
try:
    write_snapshot(named_tensors(), dest)
except OSError as exc:
    print("refused", exc.errno)
else:
    print("written")
"""


def test_file_size_limit_write_fails_and_removes_partial(tmp_path: Path) -> None:
    """Works without root: RLIMIT_FSIZE in a child makes the shard write fail part-way."""
    root = tmp_path / "stage"
    out = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "refused", out.stdout
    assert not (root / "exp1" / "step_00000001").exists() or list((root / "exp1" / "step_00000001").iterdir()) == []
    assert Staging(str(root)).list() == []
