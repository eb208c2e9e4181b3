"""Upload to S3 through s3fs's client with a sliding window of parts in flight.

Two entry points: `put_files` (local files, used by `Staging.put`) and `PartUpload` (a
write-only stream to one object, used by the snapshot writer for `s3://` destinations so an
in-loop export streams shards straight to S3 without a local copy).

s3fs's own `put` sends a file's parts in waves (read `max_concurrency` parts, wait for all of
them, read the next wave) with 50 MiB parts, so the connection pool idles at the end of every
wave; boto3's transfer manager keeps 10 parts of 8 MiB in flight at all times. This module does
the latter on s3fs's session (same credentials, endpoint, retries and error translation), one
object at a time. `bench/snapshot_io.py` measures it against boto3's `upload_file` on the same
bytes.

Contract:
- an object of at most `part_bytes` is one `PutObject`; a larger one is a multipart upload whose
  parts are numbered in order;
- at most `window` parts are in flight at once, so memory stays below
  about `window × part_bytes` (80 MiB by default) whatever the snapshot size;
- every request carries the CRC-32 of its body (`ChecksumCRC32`, computed off the IO loop), which
  S3 verifies and keeps with the object (moto keeps it without verifying); with the payload
  signing off that `layout.resolve` sets for S3 it is the body's only digest, as botocore does
  by default over HTTPS;
- `PartUpload` copies what it is given into the current part, so the caller may reuse its
  buffers once `write` returns; `write` blocks while the window is full;
- on any error the multipart upload in progress is aborted (an abort that fails is noted on the
  original error, which is re-raised); objects already written are the caller's to delete
  (`Staging.put` and the writer delete the whole destination).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import threading
import zlib
from collections.abc import Sequence
from typing import Any

from fsspec.asyn import sync

MiB = 1 << 20
PART_BYTES = 8 * MiB  # boto3's default multipart chunk size; S3's minimum part is 5 MiB
WINDOW = 10  # boto3's default max_concurrency


def _check_sizes(part_bytes: int, window: int) -> None:
    if part_bytes < 5 * MiB:
        raise ValueError(f"part_bytes must be >= 5 MiB (S3's minimum part size), got {part_bytes}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


def put_files(
    fs: Any, pairs: Sequence[tuple[str, str]], *, part_bytes: int = PART_BYTES, window: int = WINDOW
) -> None:
    """Upload each local `(path, "bucket/key")` pair with `fs` (an `s3fs.S3FileSystem`).

    One file after another (as boto3's `upload_file` does), each streamed through a `PartUpload`.
    """
    _check_sizes(part_bytes, window)
    for lpath, rpath in pairs:
        with open(lpath, "rb") as f, PartUpload(fs, rpath, part_bytes=part_bytes, window=window) as out:
            while chunk := f.read(part_bytes):
                out.write(chunk)


class PartUpload:
    """A write-only stream to one S3 object (`with PartUpload(fs, "bucket/key") as f: f.write(...)`).

    Called from one writer thread (never from s3fs's IO loop). Nothing is visible at the key until
    `close` returns: a stream of at most `part_bytes` becomes one `PutObject` at close, a longer one
    a multipart upload completed at close. Leaving the `with` block on an exception aborts it.
    """

    def __init__(self, fs: Any, rpath: str, *, part_bytes: int = PART_BYTES, window: int = WINDOW) -> None:
        _check_sizes(part_bytes, window)
        self.fs, self.rpath, self.part_bytes = fs, rpath, part_bytes
        self.bucket, self.key, _ = fs.split_path(rpath)
        self._buf = bytearray()
        self._slots = threading.BoundedSemaphore(window)
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._upload_id: str | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        while view:
            if len(self._buf) == self.part_bytes:  # a full part goes once more bytes follow it
                self._send()
            room = self.part_bytes - len(self._buf)
            self._buf += view[:room]
            view = view[room:]
        return size

    def close(self) -> None:
        """Send what is buffered and make the object visible; raise the first failure of any part."""
        if self._upload_id is None:
            body = bytes(self._buf)
            self._buf.clear()
            self._call("put_object", Body=body, ChecksumAlgorithm="CRC32", ChecksumCRC32=crc32_b64(body))
        else:
            if self._buf:
                self._send()
            parts = [f.result() for f in self._parts]
            self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": parts})
        self.fs.invalidate_cache(self.rpath)

    def abort(self) -> None:
        """Cancel the parts in flight and abort the multipart upload (if one was started)."""
        for f in self._parts:
            f.cancel()
        concurrent.futures.wait(self._parts)
        if self._upload_id is not None:
            self._call("abort_multipart_upload", UploadId=self._upload_id)

    def __enter__(self) -> PartUpload:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            try:
                self.close()
                return
            except BaseException as close_err:
                exc = close_err
        try:
            self.abort()
        except Exception as abort_err:  # the upload's own error is the one to report
            exc.add_note(f"abort_multipart_upload of {self.rpath} failed too: {abort_err!r}")
        if exc_type is None:
            raise exc

    def _send(self) -> None:
        body = bytes(self._buf)
        self._buf.clear()
        failed = next((f for f in self._parts if f.done() and f.exception()), None)
        if failed is not None:
            failed.result()  # raise it now instead of uploading more
        if self._upload_id is None:
            mpu = self._call("create_multipart_upload", ChecksumAlgorithm="CRC32")
            self._upload_id = mpu["UploadId"]
        self._slots.acquire()  # the window: block the writer while it is full
        number = len(self._parts) + 1
        future = asyncio.run_coroutine_threadsafe(self._upload_part(number, body), self.fs.loop)
        future.add_done_callback(lambda _: self._slots.release())
        self._parts.append(future)

    async def _upload_part(self, number: int, body: bytes) -> dict[str, Any]:
        crc = await asyncio.to_thread(crc32_b64, body)
        reply = await self.fs._call_s3(
            "upload_part", Bucket=self.bucket, Key=self.key, UploadId=self._upload_id, PartNumber=number,
            Body=body, ChecksumCRC32=crc,
        )
        return {"PartNumber": number, "ETag": reply["ETag"], "ChecksumCRC32": crc}

    def _call(self, method: str, **kwargs: Any) -> Any:
        return sync(self.fs.loop, self.fs._call_s3, method, Bucket=self.bucket, Key=self.key, **kwargs)


def crc32_b64(body: bytes) -> str:
    """S3's `x-amz-checksum-crc32` of `body`: the big-endian CRC-32, base64."""
    return base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
