"""prefect-aws `S3Bucket` blocks named by the staging and sinks blocks (docs/blocks.md): one way to
the bucket, never both, refused naming the field; the S3Bucket's data as the s3fs options the
project's own fields produce (`pinned_eval.aws_bucket`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from blocks import SinksBlock, StagingBlock
from pinned_eval.aws_bucket import s3_bucket_location
from pinned_eval.snapshot.layout import s3_storage_options

REPO = Path(__file__).resolve().parents[2]


def _error(cls: type, **fields: Any) -> str:
    with pytest.raises(ValidationError) as info:
        cls(**fields)
    [err] = info.value.errors()
    return str(err["msg"]).removeprefix("Value error, ")


def test_the_staging_root_comes_one_way_only() -> None:
    assert _error(StagingBlock) == ("root: required: a local directory or s3://bucket/prefix "
                                    "(or name a prefect-aws S3Bucket block in s3_bucket_block)")
    assert _error(StagingBlock, root="s3://b/p", s3_bucket_block="bkt") == (
        "root: set either root or s3_bucket_block (the S3Bucket's bucket and folder), not both")
    for field, value in [("endpoint_url", "http://127.0.0.1:9"), ("region_name", "eu-west-1"),
                         ("aws_access_key_id", "AK"), ("aws_secret_access_key", "SK")]:
        assert _error(StagingBlock, s3_bucket_block="bkt", **{field: value}) == (
            f"{field}: comes from the S3Bucket block's AwsCredentials when s3_bucket_block is set; unset it")
    assert StagingBlock(s3_bucket_block="bkt").root is None  # resolved when used, not when validated
    assert StagingBlock(root="/data/stage").root_url() == "/data/stage"


def test_the_results_root_comes_one_way_only() -> None:
    for field, value in [("results_root", "s3://b/r"), ("results_endpoint_url", "http://127.0.0.1:9")]:
        assert _error(SinksBlock, results_s3_bucket_block="bkt", **{field: value}) == (
            f"{field}: set either {field} or results_s3_bucket_block, not both")
    assert SinksBlock().results_store() is None


def test_without_prefect_aws_a_block_naming_an_s3_bucket_is_refused_naming_the_extra() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["prefect_aws"] = None  # not installed
        from pydantic import ValidationError
        from blocks import SinksBlock, StagingBlock
        StagingBlock(root="/data/stage")  # nothing else needs it
        for cls, field in ((StagingBlock, "s3_bucket_block"), (SinksBlock, "results_s3_bucket_block")):
            try:
                cls(**{field: "bkt"})
            except ValidationError as exc:
                print(exc.errors()[0]["msg"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    hint = "names a prefect-aws S3Bucket block, but prefect-aws is not installed: pip install 'pinned-eval[aws]'"
    assert out.stdout.splitlines() == [f"Value error, s3_bucket_block: {hint}",
                                       f"Value error, results_s3_bucket_block: {hint}"]


def _bucket(**creds: Any) -> dict[str, Any]:
    return {"bucket_name": "team-bkt", "bucket_folder": "/evals/stage/", "credentials": creds}


def test_an_s3_bucket_becomes_the_options_of_the_own_fields() -> None:
    url, opts = s3_bucket_location(_bucket(
        aws_access_key_id="AK", aws_secret_access_key="SK", region_name="eu-west-1",
        aws_client_parameters={"endpoint_url": "http://127.0.0.1:9000"}), "s3_bucket_block", "b")
    assert url == "s3://team-bkt/evals/stage"
    assert opts == s3_storage_options("http://127.0.0.1:9000", "eu-west-1", "AK", "SK")
    url, opts = s3_bucket_location({"bucket_name": "x", "bucket_folder": "", "credentials": {
        "aws_session_token": "TOK", "profile_name": "team", "aws_client_parameters": {}}}, "f", "b")
    assert (url, opts) == ("s3://x", {"token": "TOK", "profile": "team"})


def test_credentials_s3fs_cannot_take_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^s3_bucket_block: S3Bucket 'b': AwsCredentials.assume_role_arn is not"):
        s3_bucket_location(_bucket(assume_role_arn="arn:aws:iam::1:role/r"), "s3_bucket_block", "b")
    with pytest.raises(ValueError, match=r"^results_s3_bucket_block: S3Bucket 'b' has no AwsCredentials"):
        s3_bucket_location(_bucket(minio_root_user="u", minio_root_password="p"), "results_s3_bucket_block", "b")


@pytest.mark.parametrize(("args", "message"), [
    (["staging", "default"], "--root: required: a directory or s3://bucket/prefix (or --s3-bucket-block NAME)"),
    (["staging", "default", "--root", "s3://b/p", "--s3-bucket-block", "team"],
     "--root: set either root or s3_bucket_block (a prefect-aws S3Bucket block), not both"),
    (["staging", "default", "--s3-bucket-block", "team", "--endpoint-url", "http://127.0.0.1:9"],
     "--endpoint-url: set either endpoint_url or s3_bucket_block (a prefect-aws S3Bucket block), not both"),
    (["staging", "default", "--s3-bucket-block", "team", "--s3-keys-from-env"],
     "--s3-keys-from-env: set either s3_keys_from_env or s3_bucket_block (a prefect-aws S3Bucket block), not both"),
    (["sinks", "default", "--results-root", "s3://b/r", "--results-s3-bucket-block", "team"],
     "--results-root: set either results_root or results_s3_bucket_block (a prefect-aws S3Bucket block), not both"),
])
def test_block_save_refuses_two_ways_to_one_bucket_naming_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    from typer.testing import CliRunner

    from app.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["block", "save", *args])
    assert (result.exit_code, result.output.strip()) == (2, f"error: {message}"), result.output


def test_flags_and_the_config_file_build_blocks_naming_s3_buckets(tmp_path: Path) -> None:
    from app.block_specs import build_block
    from app.commands.init import load_project_config

    staging = build_block("staging", {"s3_bucket_block": "team", "source_root": ["s3://ckpt/run"]}, tmp_path, "x")
    assert isinstance(staging, StagingBlock)
    assert (staging.root, staging.s3_bucket_block, staging.source_roots) == (None, "team", ["s3://ckpt/run"])
    sinks = build_block("sinks", {"results_s3_bucket_block": "team-results"}, tmp_path, "x")
    assert isinstance(sinks, SinksBlock)
    assert (sinks.results_root, sinks.results_s3_bucket_block) == (None, "team-results")
    config = tmp_path / "pinned-eval.yaml"
    config.write_text("staging:\n  s3_bucket_block: team\nsinks:\n  results_s3_bucket_block: team-results\n")
    sections = load_project_config(config)
    assert build_block("staging", sections["staging"], tmp_path, "x").model_dump() == staging.model_dump() | {
        "source_roots": []}
