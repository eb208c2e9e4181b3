"""Snapshot I/O, each figure a ratio measured side by side in one run on the same bytes.

1. export: `write_snapshot` (local dir, fsync'd shards) vs a raw `numpy.tofile` of the same tensor
   bytes into one file (+ fsync) — goal >= 0.85;
2. S3 upload: `Staging.put` (`s3_upload`: 8 MiB parts, 10 in flight, CRC-32 per request, no
   payload SHA-256, marker last) vs boto3 `upload_file` of the same files to the same moto server
   (a separate `moto_server` process on 127.0.0.1) — goal >= 0.9; plus boto3 with payload signing
   off too (the same work as ours), s3fs's own `put` and one 32 MiB PUT through each client, to
   separate the upload strategy from the HTTP transport;
   and the in-loop export straight to S3 (`write_snapshot` to `s3://`, shards streamed through
   `s3_upload.PartUpload`) against boto3 uploading the same bytes from local files;
3. completeness check: 1 GiB vs 1 MiB snapshot with the same shard count, local and on S3 —
   goal ~= 1 (header reads only, so size must not matter); on S3 also the requests and bytes the
   check fetches (counted on the client) and moto's own ranged-GET time, big vs small;
4. (why the writer streams shards) one shard written by `write_snapshot` vs safetensors' own
   `save_file` and `save()` -> bytes -> write, all fsync'd.

`python -m bench.snapshot_io [--small]` (or `BENCH_SMALL=1 python -m bench snapshot_io`): --small
uses 256 MiB instead of 1 GiB. Medians of `--repeats` runs, after one warm-up run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pinned_eval.snapshot.check import check_snapshot
from pinned_eval.snapshot.staging import Staging
from pinned_eval.snapshot.writer import write_snapshot

MiB = 1 << 20
KEY = SECRET = "bench"


def _tensors(total_bytes: int, n: int) -> list[tuple[str, torch.Tensor]]:
    per = total_bytes // n // 2  # bf16 elements per tensor
    g = torch.Generator().manual_seed(0)
    return [(f"layers.{i}.weight", torch.randn(per, generator=g).to(torch.bfloat16)) for i in range(n)]


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up, not counted
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _paired(this: Callable[[], object], ref: Callable[[], object], repeats: int,
            before_this: Callable[[], object], before_ref: Callable[[], object]) -> tuple[float, float, float]:
    """Time both on the same bytes, alternating which goes first (ABBA), each after its own cleanup.

    Returns (median this s, median ref s, median of the per-round ratios ref/this): drift and noise
    from other processes hit both sides of a round alike.
    """
    sides: dict[str, tuple[Callable[[], object], Callable[[], object], list[float]]] = {
        "this": (this, before_this, []), "ref": (ref, before_ref, [])}
    for fn, before, _ in sides.values():  # warm-up: page allocation, connections
        before()
        fn()
    for i in range(repeats):
        for key in (("this", "ref") if i % 2 == 0 else ("ref", "this")):
            fn, before, out = sides[key]
            before()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    t_this, t_ref = sides["this"][2], sides["ref"][2]
    ratios = [r / t for t, r in zip(t_this, t_ref, strict=True)]
    return statistics.median(t_this), statistics.median(t_ref), statistics.median(ratios)


def _raw_write(ts: list[tuple[str, torch.Tensor]], path: Path) -> None:
    with open(path, "wb") as f:
        for _, t in ts:
            t.view(torch.uint8).numpy().tofile(f)
        f.flush()
        os.fsync(f.fileno())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_moto(log: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    moto = Path(sys.executable).with_name("moto_server")
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto_server did not start within 30 s")


Row = tuple[str, float, float, str, str]


def _export_rows(ts: list[tuple[str, torch.Tensor]], shard_bytes: int, repeats: int, work: Path) -> list[Row]:
    snap, raw = work / "export", work / "raw.bin"
    mib = sum(t.numel() * t.element_size() for _, t in ts) / MiB

    t, r, ratio = _paired(lambda: write_snapshot(ts, str(snap), max_shard_bytes=shard_bytes),
                          lambda: _raw_write(ts, raw), repeats,
                          lambda: shutil.rmtree(snap, ignore_errors=True), lambda: raw.unlink(missing_ok=True))
    shutil.rmtree(snap, ignore_errors=True)
    raw.unlink(missing_ok=True)
    return [("export: write_snapshot vs numpy.tofile (fsync'd, MiB/s)", mib / t, mib / r, f"{ratio:.2f}", ">= 0.85")]


def _fsync_path(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _encoding_rows(ts: list[tuple[str, torch.Tensor]], repeats: int, work: Path) -> list[Row]:
    """Why shards are streamed: one shard's tensors through each way of writing safetensors."""
    from safetensors.torch import save, save_file

    snap, out = work / "enc-snap", work / "enc.safetensors"
    mib = sum(t.numel() * t.element_size() for _, t in ts) / MiB
    tensors = dict(ts)

    def ours() -> None:
        write_snapshot(ts, str(snap), max_shard_bytes=1 << 62)

    def via_save_file() -> None:
        save_file(tensors, str(out), metadata={"format": "pt"})
        _fsync_path(out)

    def via_save_bytes() -> None:
        with open(out, "wb") as f:
            f.write(save(tensors, metadata={"format": "pt"}))
            f.flush()
            os.fsync(f.fileno())

    rows = []
    refs = (("safetensors save_file", via_save_file), ("safetensors save() -> bytes -> write", via_save_bytes))
    for label, ref in refs:
        t, r, ratio = _paired(ours, ref, repeats, lambda: shutil.rmtree(snap, ignore_errors=True),
                              lambda: out.unlink(missing_ok=True))
        rows.append((f"  one shard: streamed (ours) vs {label} (MiB/s)", mib / t, mib / r, f"{ratio:.2f}", "(why)"))
    shutil.rmtree(snap, ignore_errors=True)
    out.unlink(missing_ok=True)
    return rows


def _check_row(label: str, big: str, small: str, opts: dict | None, repeats: int) -> Row:
    assert check_snapshot(big, opts).complete and check_snapshot(small, opts).complete
    t_big, t_small, small_over_big = _paired(lambda: check_snapshot(big, opts), lambda: check_snapshot(small, opts),
                                             repeats, lambda: None, lambda: None)
    return (label, t_big * 1e3, t_small * 1e3, f"{1 / small_over_big:.2f}", "~ 1")


def _check_traffic_rows(big: str, small: str, opts: dict) -> list[Row]:
    """What the S3 check asks of the server, counted on the client: requests and body bytes."""
    from fsspec.asyn import sync

    from pinned_eval.snapshot.layout import resolve

    fs, _ = resolve(big, opts)  # fsspec caches instances: the one check_snapshot will use
    sync(fs.loop, fs.set_session)
    seen: list[tuple[str, int]] = []

    def count(http_response: Any, model: Any, **_: Any) -> None:
        body = int(http_response.headers.get("content-length", 0)) if model.name == "GetObject" else 0
        seen.append((model.name, body))

    fs.s3.meta.events.register("after-call.s3", count)
    traffic = []
    for url in (big, small):
        seen.clear()
        assert check_snapshot(url, opts).complete
        traffic.append((len(seen), sum(b for _, b in seen)))
    fs.s3.meta.events.unregister("after-call.s3", count)
    (n_big, b_big), (n_small, b_small) = traffic
    return [("  check S3 traffic: requests, big vs small", n_big, n_small, f"{n_big / n_small:.2f}", "= 1"),
            ("  check S3 traffic: KiB fetched, big vs small", b_big / 1024, b_small / 1024,
             f"{b_big / b_small:.2f}", "= 1")]


def run(total_bytes: int, shards: int, repeats: int, work: Path) -> list[Row]:
    import boto3
    from botocore.config import Config

    mib = total_bytes / MiB
    shard_bytes = total_bytes // shards
    ts = _tensors(total_bytes, shards * 4)
    rows = _export_rows(ts, shard_bytes, repeats, work)
    rows += _encoding_rows(ts[:4], repeats, work)
    big, tiny = work / "big", work / "tiny"
    write_snapshot(ts, str(big), max_shard_bytes=shard_bytes)
    write_snapshot(_tensors(MiB, shards * 4), str(tiny), max_shard_bytes=MiB // shards)
    rows.append(_check_row(f"check local: {mib:.0f} MiB vs 1 MiB, {shards} shards (ms)",
                           str(big), str(tiny), None, repeats * 100))

    proc, endpoint = _start_moto(work / "moto.log")
    try:
        # moto concatenates parts on CompleteMultipartUpload in Python: under load that can outlast
        # botocore's 60 s read timeout, and the retry then fails with NoSuchUpload.
        opts = {"key": KEY, "secret": SECRET, "endpoint_url": endpoint, "config_kwargs": {"read_timeout": 600}}
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                              region_name="us-east-1", config=Config(read_timeout=600))
        client.create_bucket(Bucket="bench")
        staging = Staging("s3://bench/stage", storage_options=opts, keep_snapshots=0)
        files = sorted(p for p in big.iterdir() if p.is_file())

        def wipe() -> None:  # moto holds objects in memory: one copy at a time
            for page in client.get_paginator("list_objects_v2").paginate(Bucket="bench"):
                for obj in page.get("Contents", []):
                    client.delete_object(Bucket="bench", Key=obj["Key"])

        def boto_upload() -> None:
            for p in files:
                client.upload_file(str(p), "bench", f"boto/{p.name}")

        t, r, ratio = _paired(lambda: staging.put(big, "bench", 1), boto_upload, repeats, wipe, wipe)
        rows.append(("S3 upload: Staging.put vs boto3 upload_file (MiB/s)", mib / t, mib / r,
                     f"{ratio:.2f}", ">= 0.9"))

        unsigned = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                                region_name="us-east-1",
                                config=Config(read_timeout=600, s3={"payload_signing_enabled": False}))

        def boto_unsigned() -> None:  # boto3 doing exactly our work: CRC-32, no payload SHA-256
            for p in files:
                unsigned.upload_file(str(p), "bench", f"boto/{p.name}")

        t, r, ratio = _paired(lambda: staging.put(big, "bench", 1), boto_unsigned, repeats, wipe, wipe)
        rows.append(("  Staging.put vs boto3 upload_file with payload signing off too (MiB/s)", mib / t, mib / r,
                     f"{ratio:.2f}", "(fair)"))

        def s3fs_put() -> None:  # what Staging.put did before s3_upload: s3fs's own put (parts in waves)
            staging.fs.put([str(p) for p in files], [f"bench/s3fs/{p.name}" for p in files])

        t, r, ratio = _paired(s3fs_put, boto_upload, repeats, wipe, wipe)
        rows.append(("  s3fs put (50 MiB parts in waves) vs boto3 upload_file (MiB/s)", mib / t, mib / r,
                     f"{ratio:.2f}", "(why)"))

        # the in-loop export to an s3:// staging root: tensors straight to S3, no local copy
        t, r, ratio = _paired(lambda: write_snapshot(ts, "s3://bench/direct", storage_options=staging.storage_options,
                                                     max_shard_bytes=shard_bytes),
                              boto_upload, repeats, wipe, wipe)
        rows.append(("export to S3: write_snapshot(s3://) vs boto3 upload_file of the files (MiB/s)", mib / t,
                     mib / r, f"{ratio:.2f}", "(in-loop)"))
        ts.clear()

        body = os.urandom(32 * MiB)  # the transport alone: one PUT of the same bytes, no multipart
        t, r, ratio = _paired(lambda: staging.fs.pipe_file("bench/put/a", body),
                              lambda: client.put_object(Bucket="bench", Key="put/b", Body=body), repeats, wipe, wipe)
        rows.append(("  transport alone: one 32 MiB PUT, s3fs vs boto3 (MiB/s)", 32 / t, 32 / r,
                     f"{ratio:.2f}", "(why)"))

        wipe()
        big_s3, small_s3 = staging.put(big, "bench", 1), staging.put(tiny, "bench", 2)
        rows.append(_check_row(f"check S3: {mib:.0f} MiB vs 1 MiB, {shards} shards (ms)",
                               big_s3, small_s3, opts, repeats * 3))
        rows += _check_traffic_rows(big_s3, small_s3, opts)
        shard_names = [p.name for p in files if p.name.endswith(".safetensors")]

        def heads(url: str) -> Callable[[], object]:  # the same ranged GETs the check makes, via boto3
            prefix = url.removeprefix("s3://bench/")
            return lambda: [client.get_object(Bucket="bench", Key=f"{prefix}/{n}", Range="bytes=0-65535")["Body"].read()
                            for n in shard_names]

        t_big, t_small = _median_time(heads(big_s3), repeats * 3), _median_time(heads(small_s3), repeats * 3)
        rows.append(("  moto alone: 64 KiB ranged GET of each shard, big vs small (ms)", t_big * 1e3,
                     t_small * 1e3, f"{t_big / t_small:.2f}", "(server)"))
    except Exception:
        tail = (work / "moto.log").read_text(errors="replace").splitlines()[-30:]
        print("moto_server log (last lines):", *tail, sep="\n", file=sys.stderr)
        raise
    finally:
        proc.terminate()
        proc.wait(10)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench.snapshot_io", description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", default=os.environ.get("BENCH_SMALL") == "1",
                    help="256 MiB instead of 1 GiB")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=None, help="work dir (default: a temp dir)")
    args = ap.parse_args(argv or [])
    total = (256 if args.small else 1024) * MiB
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = run(total, args.shards, args.repeats, Path(tmp))
    print(f"snapshot_io: {total // MiB} MiB, {args.shards} shards, median of {args.repeats}")
    print(f"| {'measure':<78} | {'this':>9} | {'reference':>9} | {'ratio':>5} | goal     |")
    print(f"|{'-' * 80}|{'-' * 11}|{'-' * 11}|{'-' * 7}|----------|")
    for name, this, ref, ratio, goal in rows:
        print(f"| {name:<78} | {this:>9.1f} | {ref:>9.1f} | {ratio:>5} | {goal:<8} |")


if __name__ == "__main__":
    main(sys.argv[1:])
