"""S3 with the staging block's credentials only: the watch evaluator over an `s3://` prefix of
`step_N` checkpoints, and an `EvalClient` exporting into an `s3://` staging root, both end in
measured points on the CPU fleet (moto's S3 server, the deployed worker).

Both run twice: the staging block's own S3 fields, and a staging block naming a prefect-aws
`S3Bucket` block (with its `AwsCredentials`) saved to the session's server. Neither this process
nor the worker (and its flow-run processes) has AWS variables or config
files that could supply credentials or an endpoint: the negative control shows botocore finds
none, so every S3 call that succeeds used the block's endpoint and keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil
import pytest
from botocore.exceptions import NoCredentialsError

from blocks import StagingBlock
from flows.watch import scan, watch_checkpoints
from pinned_eval.events import BlockNames
from pinned_eval.sinks import JsonlSink
from pinned_eval.snapshot.layout import resolve
from pinned_eval.snapshot.writer import write_snapshot
from tests.deploykit import Deployed, runs_of_deployment, wait_for, without_aws_credentials
from tests.pointkit import PointEnv, write_step_snapshot
from tests.s3_fixtures import KEY, SECRET, S3Server, s3_server, save_prefect_aws_bucket  # noqa: F401 - fixture
from trainer_integration.client import EvalClient

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["block-fields", "prefect-aws"])
def block_only_s3(
    request: pytest.FixtureRequest, point_env: PointEnv, deployed: Deployed, s3_server: S3Server,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> tuple[PointEnv, str]:
    """`point_env` with its staging block on a fresh bucket (keys in the block only); returns the bucket URL.
    `block-fields`: the staging block's own S3 fields; `prefect-aws`: the staging block names a
    prefect-aws S3Bucket block (bucket, folder `stage`, AwsCredentials with the keys and endpoint)."""
    clean = without_aws_credentials(dict(os.environ), tmp_path)
    for name in [k for k in os.environ if k not in clean]:
        monkeypatch.delenv(name)
    for name, value in clean.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    worker_env = psutil.Process(deployed.worker_pid).environ()
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL"} & set(worker_env)
    assert not Path(worker_env["AWS_SHARED_CREDENTIALS_FILE"]).exists()
    name = s3_server.make_bucket('blk')
    bucket = f"s3://{name}"
    where: dict[str, Any] = {"root": f"{bucket}/stage", "endpoint_url": s3_server.endpoint_url,
                             "aws_access_key_id": KEY, "aws_secret_access_key": SECRET}
    if request.param == "prefect-aws":
        where = {"s3_bucket_block": save_prefect_aws_bucket(s3_server, name, "stage")}
    StagingBlock(
        **where,
        source_roots=[f"{bucket}/trainer"],  # where the trainer saves its checkpoints (the watched prefix)
        keep_snapshots=0,
        cache_dir=str(tmp_path / "cache"),
    ).save(point_env.blocks["staging"], overwrite=True)
    with pytest.raises(NoCredentialsError):  # nothing but the block can authenticate
        scan(f"{bucket}/stage", {"endpoint_url": s3_server.endpoint_url})
    return point_env, bucket


def _measured(env: PointEnv) -> dict[int, set[str | None]]:
    out: dict[int, set[str | None]] = {}
    for row in JsonlSink(env.jsonl).read(env.run):
        if row.state == "measured":
            out.setdefault(row.step, set()).add(row.weight_version)
    return out


def test_watch_over_an_s3_prefix_uses_the_block_credentials(
    block_only_s3: tuple[PointEnv, str], deployed: Deployed, s3_server: S3Server, tiny_model: Path, tmp_path: Path  # noqa: F811
) -> None:
    env, bucket = block_only_s3
    root = f"{bucket}/trainer/checkpoints"
    fs, path = resolve(root, s3_server.storage_options)  # the trainer's own upload (test-side keys)
    for step in (10, 20):
        local = write_step_snapshot(tiny_model, str(tmp_path / f"step_{step}"), scale=0.001 * step, seed=step)
        fs.put(local, f"{path}/step_{step}", recursive=True)
    decisions = watch_checkpoints(run=env.run, root=root, **env.blocks)
    assert {d.step: d.action for d in decisions} == {10: "requested", 20: "requested"}

    def done():  # type: ignore[no-untyped-def]
        runs = runs_of_deployment(deployed.deployment_id, env.run)
        return len(runs) == 2 and all(r.state.is_final() for r in runs) and runs

    runs = wait_for(done, 240, "two terminal points", interval_s=1)
    assert all(r.state.name == "Completed" for r in runs), [(r.name, r.state.name, r.state.message) for r in runs]
    assert _measured(env) == {10: {"10"}, 20: {"20"}}
    assert {d.step for d in scan(root, s3_server.storage_options)} == {10, 20}, "hf checkpoints are never deleted"


def test_eval_client_exports_to_an_s3_staging_root_with_the_block_credentials(
    block_only_s3: tuple[PointEnv, str], deployed: Deployed, s3_server: S3Server, tiny_model: Path, tmp_path: Path  # noqa: F811
) -> None:
    env, bucket = block_only_s3
    local = Path(write_step_snapshot(tiny_model, str(tmp_path / "weights"), scale=0.002, seed=3))
    from safetensors.torch import load_file

    tensors = {n: t for f in sorted(local.glob("*.safetensors")) for n, t in load_file(f).items()}
    client = EvalClient(
        env.run,
        deployed.api_url,
        blocks=BlockNames(**env.blocks),
        staging_root=f"{bucket}/stage",
        spool_dir=tmp_path / "spool",
    )
    with client:
        def export(step: int, dest: str) -> None:  # what a trainer's exporter does with the options
            write_snapshot(sorted(tensors.items()), dest, base_hf_dir=str(tiny_model),
                           storage_options=client.storage_options)

        result = client.dispatch(3, final=True, export=export)
        assert result.action == "requested", result
        assert client.storage_options["endpoint_url"] == s3_server.endpoint_url
        [outcome] = client.drain(timeout=240)
    assert outcome.state == "measured", outcome
    assert _measured(env) == {3: {"3"}}
    fs, path = resolve(f"{bucket}/stage/{env.run}", s3_server.storage_options)
    assert not fs.exists(f"{path}/step_00000003"), "the point retired its S3 snapshot (keep_snapshots=0)"
