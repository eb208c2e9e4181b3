"""A prefect-aws `S3Bucket` block's data as the s3fs options pinned-eval's own S3 fields produce
(no Prefect, no prefect-aws import: the trainer reads the block over REST, the blocks load it).

`{"bucket_name", "bucket_folder", "credentials": {AwsCredentials fields, secrets in clear}}` becomes
`s3://<bucket_name>[/<bucket_folder>]` and `s3_storage_options(endpoint_url from
credentials.aws_client_parameters, region_name, access key, secret)` plus `token` (the session
token) and `profile` (`profile_name`). Credentials s3fs cannot take as options (`assume_role_arn`,
MinIO credentials) raise ValueError naming `field`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pinned_eval.snapshot.layout import s3_storage_options

S3_BUCKET_SLUG = "s3-bucket"  # prefect-aws's block type


def s3_bucket_location(data: Mapping[str, Any], field: str, name: str) -> tuple[str, dict[str, Any]]:
    """(`s3://` URL, s3fs options) of the S3Bucket block `name` whose document data is `data`."""
    creds = data.get("credentials")
    if not isinstance(creds, Mapping) or "minio_root_user" in creds:
        raise ValueError(f"{field}: S3Bucket {name!r} has no AwsCredentials (only AwsCredentials is supported)")
    if creds.get("assume_role_arn"):
        raise ValueError(f"{field}: S3Bucket {name!r}: AwsCredentials.assume_role_arn is not supported "
                         "(s3fs takes keys, a session token or a profile)")
    params = creds.get("aws_client_parameters") or {}
    opts = s3_storage_options(params.get("endpoint_url"), creds.get("region_name"), creds.get("aws_access_key_id"),
                              creds.get("aws_secret_access_key"))
    if creds.get("aws_session_token"):
        opts["token"] = creds["aws_session_token"]
    if creds.get("profile_name"):
        opts["profile"] = creds["profile_name"]
    return s3_bucket_url(data), opts


def s3_bucket_url(data: Mapping[str, Any]) -> str:
    """`s3://<bucket_name>[/<bucket_folder>]` of an S3Bucket block's data (no secret needed)."""
    folder = str(data.get("bucket_folder") or "").strip("/")
    return f"s3://{data['bucket_name']}" + (f"/{folder}" if folder else "")
