"""A results root through a prefect-aws `S3Bucket` block on moto's S3 server: the sinks block,
saved to the session's Prefect server and loaded by name, writes and reads a point's samples under
the bucket's folder; the secret never shows in the block's repr. (The staging root through an
S3Bucket: tests/e2e/test_staging_s3.py and tests/e2e/test_s3_credentials.py, `prefect-aws`.)"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from blocks import SinksBlock, StagingBlock
from pinned_eval.results.store import SAMPLES
from pinned_eval.results.tables import generation_row, samples_table
from tests.s3_fixtures import S3Server, s3_server, save_prefect_aws_bucket  # noqa: F401 - fixture

pytestmark = pytest.mark.e2e
SECRET = f"s3cr3t-{uuid.uuid4().hex}"


def test_a_results_root_through_an_s3_bucket_block(prefect_server: str, s3_server: S3Server) -> None:  # noqa: F811
    bucket = s3_server.make_bucket("res")
    name = save_prefect_aws_bucket(s3_server, bucket, "evals/results", key="AKIDRESULTS", secret=SECRET)
    SinksBlock(results_s3_bucket_block=name).save(name)
    sinks = SinksBlock.load(name)
    store = sinks.results_store()
    assert store is not None
    gen = {"dataset": "d", "prompt_index": 0, "sample_index": 0, "prompt": "p0", "label": "x", "metadata": {},
           "response": "r", "response_len": 1, "finish_reason": "stop", "weight_version": "7", "prompt_tokens": 2}
    table = samples_table([{**generation_row(gen), "reward": 1.0}], key="k")
    url = store.write("exp", 7, SAMPLES, table)
    assert url == f"s3://{bucket}/evals/results/exp/step_00000007/{SAMPLES}"
    assert store.read("exp", 7, SAMPLES).to_pylist() == table.to_pylist()
    listed = s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]
    assert [o["Key"] for o in listed] == [f"evals/results/exp/step_00000007/{SAMPLES}"]
    assert SECRET not in repr(sinks) and SECRET not in str(sinks.model_dump())


def test_a_missing_s3_bucket_block_is_one_line_naming_the_field(prefect_server: str) -> None:
    block = StagingBlock(s3_bucket_block=f"nope-{uuid.uuid4().hex[:8]}")
    with pytest.raises(ValueError) as info:
        block.staging()
    assert str(info.value) == f"s3_bucket_block: no prefect-aws S3Bucket block named {block.s3_bucket_block!r}"


def test_the_staging_block_resolves_the_bucket_once(prefect_server: str, s3_server: S3Server,  # noqa: F811
                                                    tmp_path: Path) -> None:
    bucket = s3_server.make_bucket("stg")
    name = save_prefect_aws_bucket(s3_server, bucket, "", secret=SECRET)
    block = StagingBlock(s3_bucket_block=name, cache_dir=str(tmp_path / "cache"))
    assert block.root_url() == f"s3://{bucket}"
    assert block.storage_options()["secret"] == SECRET and block.s3_options()["endpoint_url"] == s3_server.endpoint_url
    assert SECRET not in repr(block) and SECRET not in block.model_dump_json()
    assert block.all_source_roots() == [f"s3://{bucket}"]


def test_request_checks_a_source_against_the_s3_bucket_root_before_sending(
    prefect_server: str, s3_server: S3Server  # noqa: F811
) -> None:
    from prefect import get_client

    from app.commands._cli import CliError
    from app.commands.points import check_source_roots
    from pinned_eval.points import SnapshotSource

    bucket = s3_server.make_bucket("req")
    name = save_prefect_aws_bucket(s3_server, bucket, "stage")
    StagingBlock(s3_bucket_block=name).save(name)
    gone = f"gone-{uuid.uuid4().hex[:8]}"
    StagingBlock(s3_bucket_block=gone).save(gone)
    with get_client(sync_client=True) as client:
        check_source_roots(client, SnapshotSource(kind="staged", path=f"s3://{bucket}/stage/r/step_1"), name)
        with pytest.raises(CliError) as info:
            check_source_roots(client, SnapshotSource(kind="staged", path=f"s3://{bucket}/elsewhere/x"), name)
        assert info.value.code == 2 and info.value.message.startswith(
            f"--source: s3://{bucket}/elsewhere/x is outside the source roots of staging block {name!r} "
            f"(s3://{bucket}/stage); nothing was sent.")
        with pytest.raises(CliError) as info:
            check_source_roots(client, SnapshotSource(kind="staged", path=f"s3://{bucket}/stage/x"), gone)
    assert (info.value.code, info.value.message) == (2, f"--staging: staging block {gone!r} names the S3Bucket "
                                                        f"block {gone!r}, which does not exist; nothing was sent")
