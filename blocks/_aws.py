"""prefect-aws `S3Bucket` blocks named by a pinned-eval block, resolved into the s3fs/fsspec
options the project's own S3 fields produce (`pinned_eval.snapshot.layout.s3_storage_options`), so
every S3 code path is the same either way.

`S3Bucket(bucket_name, bucket_folder, credentials=AwsCredentials(...))` becomes the URL
`s3://<bucket_name>[/<bucket_folder>]` and the options: `endpoint_url` from
`credentials.aws_client_parameters.endpoint_url`, `client_kwargs.region_name` from
`region_name`, `key` / `secret` / `token` from the access key, secret and session token,
`profile` from `profile_name`. Credentials that s3fs cannot take as options (`assume_role_arn`,
MinIO credentials) are refused naming the field. prefect-aws is the `aws` extra: a block naming an
S3Bucket without it is refused when it loads. The options hold secrets: callers keep them out of
repr, logs and argv (private attributes, passed to fsspec in-process only).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from blocks._meta import load_block
from pinned_eval.snapshot.layout import s3_storage_options

AWS_HINT = "pip install 'pinned-eval[aws]'"


def require_prefect_aws(field: str) -> None:
    """ValueError naming `field` and the extra unless prefect-aws is importable."""
    if importlib.util.find_spec("prefect_aws") is None:
        raise ValueError(f"{field}: names a prefect-aws S3Bucket block, but prefect-aws is not installed: {AWS_HINT}")


def resolve_s3_bucket(name: str, field: str) -> tuple[str, dict[str, Any]]:
    """The saved S3Bucket block `name` as (`s3://` URL, s3fs options); ValueError naming `field`
    when it is missing or its credentials cannot be expressed as s3fs options."""
    require_prefect_aws(field)
    from prefect_aws import AwsCredentials, S3Bucket

    try:
        bucket = load_block(S3Bucket, name)
    except ValueError as exc:
        raise ValueError(f"{field}: no prefect-aws S3Bucket block named {name!r} ({exc})") from None
    creds = bucket.credentials
    if not isinstance(creds, AwsCredentials):
        raise ValueError(f"{field}: S3Bucket {name!r} has {type(creds).__name__}; only AwsCredentials is supported")
    if creds.assume_role_arn:
        raise ValueError(f"{field}: S3Bucket {name!r}: AwsCredentials.assume_role_arn is not supported "
                         "(s3fs takes keys, a session token or a profile)")
    secret = creds.aws_secret_access_key.get_secret_value() if creds.aws_secret_access_key else None
    opts = s3_storage_options(creds.aws_client_parameters.endpoint_url, creds.region_name,
                              creds.aws_access_key_id, secret)
    if creds.aws_session_token:
        opts["token"] = creds.aws_session_token
    if creds.profile_name:
        opts["profile"] = creds.profile_name
    folder = bucket.bucket_folder.strip("/")
    return f"s3://{bucket.bucket_name}" + (f"/{folder}" if folder else ""), opts
