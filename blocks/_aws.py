"""prefect-aws `S3Bucket` blocks named by a pinned-eval block, resolved into the s3fs/fsspec
options the project's own S3 fields produce (`pinned_eval.snapshot.layout.s3_storage_options`), so
every S3 code path is the same either way.

`S3Bucket(bucket_name, bucket_folder, credentials=AwsCredentials(...))` becomes the URL
`s3://<bucket_name>[/<bucket_folder>]` and the options (`pinned_eval.aws_bucket`: `endpoint_url`
from `credentials.aws_client_parameters.endpoint_url`, `client_kwargs.region_name` from
`region_name`, `key` / `secret` / `token` from the access key, secret and session token,
`profile` from `profile_name`). Credentials that s3fs cannot take as options (`assume_role_arn`,
MinIO credentials) are refused naming the field. prefect-aws is the `aws` extra: a block naming an
S3Bucket without it is refused when it loads. The options hold secrets: callers keep them out of
repr, logs and argv (private attributes, passed to fsspec in-process only).
"""

from __future__ import annotations

from typing import Any

from blocks._meta import load_block
from pinned_eval.aws_bucket import s3_bucket_location

AWS_HINT = "pip install 'pinned-eval[aws]'"


def require_prefect_aws(field: str) -> None:
    """ValueError naming `field` and the extra unless prefect-aws is importable."""
    try:
        import prefect_aws  # noqa: F401
    except ImportError:
        raise ValueError(f"{field}: names a prefect-aws S3Bucket block, but prefect-aws is not installed: "
                         f"{AWS_HINT}") from None


def resolve_s3_bucket(name: str, field: str) -> tuple[str, dict[str, Any]]:
    """The saved S3Bucket block `name` as (`s3://` URL, s3fs options); ValueError naming `field`
    when it is missing or its credentials cannot be expressed as s3fs options."""
    require_prefect_aws(field)
    from prefect_aws import AwsCredentials, S3Bucket

    try:
        bucket = load_block(S3Bucket, name)
    except ValueError as exc:  # one line: a missing block, or the first line of why it does not load
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if why.startswith("Unable to find"):
            raise ValueError(f"{field}: no prefect-aws S3Bucket block named {name!r}") from None
        raise ValueError(f"{field}: prefect-aws S3Bucket block {name!r} does not load: {why}") from None
    creds = bucket.credentials
    if not isinstance(creds, AwsCredentials):
        raise ValueError(f"{field}: S3Bucket {name!r} has {type(creds).__name__}; only AwsCredentials is supported")
    secret = creds.aws_secret_access_key.get_secret_value() if creds.aws_secret_access_key else None
    data = {"bucket_name": bucket.bucket_name, "bucket_folder": bucket.bucket_folder,
            "credentials": creds.model_dump(mode="json") | {"aws_secret_access_key": secret}}
    return s3_bucket_location(data, field, name)
