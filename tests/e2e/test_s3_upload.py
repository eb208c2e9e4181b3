"""The windowed S3 uploader against moto (real S3 protocol), directly and behind a faulty proxy."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import s3fs

from pinned_eval.snapshot import s3_upload
from pinned_eval.snapshot.layout import unsigned_payload
from pinned_eval.snapshot.staging import Staging
from tests.reliability.netfaults import FaultyHTTPProxy, Rule
from tests.s3_fixtures import KEY, SECRET, S3Server, s3_server  # noqa: F401 - fixture

pytestmark = pytest.mark.e2e

MiB = 1 << 20
PART = 5 * MiB  # S3's minimum part size: a 12 MiB file is parts of 5, 5 and 2 MiB


def _fs(endpoint: str) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(key=KEY, secret=SECRET, endpoint_url=endpoint, skip_instance_cache=True)


def _files(tmp_path: Path) -> dict[str, bytes]:
    blobs = {"big.bin": os.urandom(12 * MiB), "exact.bin": os.urandom(PART), "small.json": b'{"a": 1}'}
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
    return blobs


def test_files_arrive_byte_identical_large_ones_in_parts(s3_server: S3Server, tmp_path: Path) -> None:  # noqa: F811
    bucket = s3_server.make_bucket("up")
    blobs = _files(tmp_path)
    fs = _fs(s3_server.endpoint_url)
    s3_upload.put_files(fs, [(str(tmp_path / n), f"{bucket}/snap/{n}") for n in blobs], part_bytes=PART, window=2)
    client = s3_server.client()
    for name, data in blobs.items():
        assert fs.cat_file(f"{bucket}/snap/{name}") == data, name
    # a multipart object's ETag ends in -<parts>; a single PUT's does not
    assert client.head_object(Bucket=bucket, Key="snap/big.bin")["ETag"].strip('"').endswith("-3")
    assert "-" not in client.head_object(Bucket=bucket, Key="snap/exact.bin")["ETag"]
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    # every body went with its CRC-32, which the server keeps with the object (multipart: per part)
    for name in ("exact.bin", "small.json"):
        head = client.head_object(Bucket=bucket, Key=f"snap/{name}", ChecksumMode="ENABLED")
        assert head["ChecksumCRC32"] == s3_upload.crc32_b64(blobs[name]), name
    # a multipart object's is S3's composite: the CRC-32 of the parts' CRC-32s, "-<parts>"
    big = blobs["big.bin"]
    part_crcs = b"".join(base64.b64decode(s3_upload.crc32_b64(big[i : i + PART])) for i in range(0, len(big), PART))
    got = client.get_object(Bucket=bucket, Key="snap/big.bin", ChecksumMode="ENABLED", PartNumber=1)
    assert got["ChecksumCRC32"] == f"{s3_upload.crc32_b64(part_crcs)}-3"


def test_payload_signing_is_off_unless_the_caller_set_it() -> None:
    opts = {"key": "k", "config_kwargs": {"read_timeout": 9, "s3": {"addressing_style": "path"}}}
    assert unsigned_payload(opts) == {
        "key": "k",
        "config_kwargs": {"read_timeout": 9, "s3": {"addressing_style": "path", "payload_signing_enabled": False}},
    }
    assert opts["config_kwargs"]["s3"] == {"addressing_style": "path"}, "the caller's dict is not changed"
    signed = {"config_kwargs": {"s3": {"payload_signing_enabled": True}}}
    assert unsigned_payload(signed) == signed


def test_bad_arguments_are_refused_before_any_request(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="part_bytes must be >= 5 MiB"):
        s3_upload.put_files(object(), [], part_bytes=MiB)
    with pytest.raises(ValueError, match="window must be >= 1"):
        s3_upload.put_files(object(), [], window=0)


def test_a_transient_part_failure_is_retried(s3_server: S3Server, tmp_path: Path) -> None:  # noqa: F811
    bucket = s3_server.make_bucket("up")
    blobs = _files(tmp_path)
    proxy = FaultyHTTPProxy(s3_server.endpoint_url, [Rule("error", methods=("PUT",), path_contains="partNumber=2",
                                                          times=1)])
    try:
        s3_upload.put_files(_fs(proxy.url), [(str(tmp_path / "big.bin"), f"{bucket}/k")], part_bytes=PART)
        assert len(proxy.seen("error", "partNumber=2")) == 1
    finally:
        proxy.close()
    assert _fs(s3_server.endpoint_url).cat_file(f"{bucket}/k") == blobs["big.bin"]


def test_a_persistent_part_failure_aborts_the_upload(s3_server: S3Server, tmp_path: Path) -> None:  # noqa: F811
    bucket = s3_server.make_bucket("up")
    _files(tmp_path)
    proxy = FaultyHTTPProxy(s3_server.endpoint_url, [Rule("error", methods=("PUT",), path_contains="partNumber=2")])
    try:
        with pytest.raises(OSError):
            s3_upload.put_files(_fs(proxy.url), [(str(tmp_path / "big.bin"), f"{bucket}/k")], part_bytes=PART)
        assert proxy.seen("pass", "uploadId=") and not proxy.seen("pass", "partNumber=2")
    finally:
        proxy.close()
    client = s3_server.client()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == [], "the upload was aborted"
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0, "nothing was completed"


def test_staging_put_to_s3_uses_it_and_leaves_nothing_on_failure(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Path,
) -> None:
    from pinned_eval.snapshot.writer import write_snapshot
    from tests.snapshot_fixtures import named_tensors

    bucket = s3_server.make_bucket("up")
    src = tmp_path / "snap"
    write_snapshot(named_tensors(), str(src))
    opts = {"key": KEY, "secret": SECRET}
    url = Staging(f"s3://{bucket}/stage", {**opts, "endpoint_url": s3_server.endpoint_url}).put(src, "exp1", 3)
    assert Staging(f"s3://{bucket}/stage", {**opts, "endpoint_url": s3_server.endpoint_url}).check(url).complete

    proxy = FaultyHTTPProxy(s3_server.endpoint_url, [Rule("error", methods=("PUT",), path_contains="index.json")])
    try:
        with pytest.raises(OSError):
            Staging(f"s3://{bucket}/stage", {**opts, "endpoint_url": proxy.url}).put(src, "exp1", 4)
    finally:
        proxy.close()
    assert _fs(s3_server.endpoint_url).find(f"{bucket}/stage/exp1/step_00000004") == []


def _pieces(data: bytes, sizes: tuple[int, ...] = (1, 3 * MiB + 7, 4096)) -> list[memoryview]:
    """`data` cut into odd-sized pieces, as a shard header and tensor buffers arrive."""
    out, i, k = [], 0, 0
    while i < len(data):
        n = sizes[k % len(sizes)]
        out.append(memoryview(data)[i : i + n])
        i, k = i + n, k + 1
    return out


def test_a_stream_becomes_parts_and_is_invisible_until_closed(s3_server: S3Server) -> None:  # noqa: F811
    bucket = s3_server.make_bucket("up")
    fs, client = _fs(s3_server.endpoint_url), s3_server.client()
    data = os.urandom(12 * MiB + 123)
    with s3_upload.PartUpload(fs, f"{bucket}/big", part_bytes=PART, window=2) as f:
        for piece in _pieces(data):
            f.write(piece)
        assert client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0, "nothing visible before close"
    assert fs.cat_file(f"{bucket}/big") == data
    assert client.head_object(Bucket=bucket, Key="big")["ETag"].strip('"').endswith("-3")

    small = os.urandom(1000)
    with s3_upload.PartUpload(fs, f"{bucket}/small", part_bytes=PART) as f:
        f.write(small)
    head = client.head_object(Bucket=bucket, Key="small", ChecksumMode="ENABLED")
    assert "-" not in head["ETag"] and head["ChecksumCRC32"] == s3_upload.crc32_b64(small)
    assert fs.cat_file(f"{bucket}/small") == small
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_an_error_in_the_writer_aborts_the_stream(s3_server: S3Server) -> None:  # noqa: F811
    bucket = s3_server.make_bucket("up")
    fs, client = _fs(s3_server.endpoint_url), s3_server.client()
    with pytest.raises(RuntimeError, match="tensor went missing"), s3_upload.PartUpload(
        fs, f"{bucket}/k", part_bytes=PART
    ) as f:
        f.write(os.urandom(11 * MiB))  # two parts sent, one buffered
        raise RuntimeError("tensor went missing")
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0


def test_a_persistent_part_failure_fails_the_stream_and_aborts(s3_server: S3Server) -> None:  # noqa: F811
    bucket = s3_server.make_bucket("up")
    proxy = FaultyHTTPProxy(s3_server.endpoint_url, [Rule("error", methods=("PUT",), path_contains="partNumber=2")])
    try:
        with pytest.raises(OSError), s3_upload.PartUpload(_fs(proxy.url), f"{bucket}/k", part_bytes=PART) as f:
            for piece in _pieces(os.urandom(16 * MiB)):
                f.write(piece)
        assert not proxy.seen("pass", "partNumber=2")
    finally:
        proxy.close()
    client = s3_server.client()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0


def test_the_writer_streams_a_large_shard_to_s3_in_parts(s3_server: S3Server) -> None:  # noqa: F811
    import torch

    from pinned_eval.snapshot.check import check_snapshot
    from pinned_eval.snapshot.writer import write_snapshot

    bucket = s3_server.make_bucket("up")
    opts = {"key": KEY, "secret": SECRET, "endpoint_url": s3_server.endpoint_url}
    g = torch.Generator().manual_seed(0)
    tensors = [(f"w{i}", torch.randn(1 << 20, generator=g)) for i in range(5)]  # 5 x 4 MiB, one shard
    url = f"s3://{bucket}/stage/exp1/step_00000001"
    res = write_snapshot(tensors, url, storage_options=opts)
    assert res.shards == 1 and check_snapshot(url, opts).complete
    key = "stage/exp1/step_00000001/model-00001-of-00001.safetensors"
    assert s3_server.client().head_object(Bucket=bucket, Key=key)["ETag"].strip('"').endswith("-3"), "8 MiB parts"
    from safetensors.torch import load

    got = load(_fs(s3_server.endpoint_url).cat_file(f"{bucket}/{key}"))
    for name, t in tensors:
        assert torch.equal(got[name], t), name
