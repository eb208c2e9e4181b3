"""A real S3 protocol endpoint for tests: moto's ThreadedMotoServer on 127.0.0.1, an OS-chosen port.

Import the fixtures into a test module or conftest (`from tests.s3_fixtures import s3_server,
s3_bucket`). `s3_server` is session-scoped (one server per test session); `s3_bucket` creates a
fresh, uniquely named bucket per test and yields its `s3://` URL. Credentials are passed
explicitly through `storage_options`, so no AWS environment variable is touched.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

KEY, SECRET, REGION = "testing", "testing", "us-east-1"


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options; no `region_name` in client_kwargs (s3fs' mkdir would send a LocationConstraint)."""
        return {"key": KEY, "secret": SECRET, "endpoint_url": self.endpoint_url}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=KEY,
                            aws_secret_access_key=SECRET, region_name=REGION)

    def make_bucket(self, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def save_prefect_aws_bucket(server: S3Server, bucket: str, folder: str = "", *, key: str = KEY,
                            secret: str = SECRET) -> str:
    """Save prefect-aws `AwsCredentials` (the server's keys and endpoint) and an `S3Bucket` naming
    `bucket`/`folder` with them to the current Prefect server; returns the S3Bucket block's name."""
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    name = f"aws-{uuid.uuid4().hex[:10]}"
    creds = AwsCredentials(aws_access_key_id=key, aws_secret_access_key=secret,
                           aws_client_parameters=AwsClientParameters(endpoint_url=server.endpoint_url))
    creds.save(name)
    S3Bucket(bucket_name=bucket, bucket_folder=folder, credentials=AwsCredentials.load(name)).save(name)
    return name


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    return f"s3://{s3_server.make_bucket()}"
