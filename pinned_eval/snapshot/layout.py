"""What a snapshot looks like on storage: file names, the `.complete` manifest, fsspec resolution.

Invariants shared by the writer, the check and staging (no torch import here):
- weights live in `model-{i:05d}-of-{N:05d}.safetensors` (i from 1), listed in
  `model.safetensors.index.json` = {"metadata": {"total_size", EXPORT_ID_KEY}, "weight_map"};
- every shard header's `__metadata__` carries the same `export_id` as the index and the marker,
  so a marker left over from an earlier export is detected from headers alone;
- `.complete` is written last and holds a `Manifest` (JSON); a bare marker (e.g. miles'
  `touch .complete`) is accepted, but staleness is then judged by modification times only.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import fsspec
from fsspec import AbstractFileSystem
from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.durable import fsync_path as fsync_path

MARKER = ".complete"
RETIRED = ".retired"  # staging's keep-ring mark: the point that used this snapshot is done with it
INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"  # a PEFT LoRA adapter snapshot: this config + the weights below
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_INDEX = "adapter_model.safetensors.index.json"
MANIFEST_FORMAT: Literal["pinned-eval-snapshot/1"] = "pinned-eval-snapshot/1"
EXPORT_ID_KEY = "pinned_eval_export_id"
# Never copied from a base HF dir: weights in any format and their indexes.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".distcp")


def shard_name(i: int, n: int) -> str:
    """1-based shard file name, the Hugging Face convention."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")


class Manifest(BaseModel):
    """Content of `.complete`: vouches for exactly one export (id, index digest, file sizes)."""

    model_config = ConfigDict(extra="ignore")

    format: Literal["pinned-eval-snapshot/1"] = MANIFEST_FORMAT
    export_id: str
    index_sha256: str
    total_size: int = Field(ge=0)
    files: dict[str, int] = Field(description="every file of the snapshot except the marker -> size")
    created_at: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class IndexMetadata(BaseModel):
    model_config = ConfigDict(extra="allow")
    total_size: int = Field(ge=0)
    export_id: str | None = Field(default=None, alias="pinned_eval_export_id")  # = EXPORT_ID_KEY


class Index(BaseModel):
    model_config = ConfigDict(extra="allow")
    metadata: IndexMetadata
    weight_map: dict[str, str]


def resolve(url: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """(filesystem, path without protocol) for a local path or URL.

    S3 listings are not cached: other processes (trainers, other points) write the same prefixes.
    S3 payload signing is off unless the caller set it (`unsigned_payload`).
    """
    opts = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        opts.setdefault("use_listings_cache", False)
        opts = unsigned_payload(opts)
    fs, path = fsspec.core.url_to_fs(url, **opts)
    return fs, path.rstrip("/") or path


def s3_storage_options(
    endpoint_url: str | None = None,
    region_name: str | None = None,
    key: str | None = None,
    secret: str | None = None,
) -> dict[str, Any]:
    """s3fs options from a staging configuration's S3 fields (unset fields are left to botocore)."""
    opts: dict[str, Any] = {}
    if endpoint_url:
        opts["endpoint_url"] = endpoint_url
    if region_name:
        opts["client_kwargs"] = {"region_name": region_name}
    if key:
        opts["key"] = key
    if secret:
        opts["secret"] = secret
    return opts


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def unsigned_payload(storage_options: dict[str, Any]) -> dict[str, Any]:
    """`storage_options` with botocore's payload signing off unless the caller set it.

    Over HTTPS botocore already sends `UNSIGNED-PAYLOAD` when a checksum header is present; over
    plain HTTP (a local MinIO, moto) it SHA-256-hashes every body on s3fs's single IO thread, which
    halves upload throughput. Integrity comes from the CRC-32 each request carries (in a signed
    header) and the server verifies.
    """
    config = dict(storage_options.get("config_kwargs") or {})
    s3_config = dict(config.get("s3") or {})
    s3_config.setdefault("payload_signing_enabled", False)
    return {**storage_options, "config_kwargs": {**config, "s3": s3_config}}


def is_local(fs: AbstractFileSystem) -> bool:
    return "file" in _protocols(fs)


def is_s3(fs: AbstractFileSystem) -> bool:
    return "s3" in _protocols(fs)


def join(fs: AbstractFileSystem, base: str, name: str) -> str:
    return f"{base.rstrip(fs.sep)}{fs.sep}{name}" if is_local(fs) else f"{base.rstrip('/')}/{name}"


def to_url(fs: AbstractFileSystem, path: str) -> str:
    """The user-facing form of a resolved path: plain path locally, `s3://...` otherwise."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def file_mtime(info: dict[str, Any]) -> float:
    """Modification time (epoch seconds) from an fsspec `ls(detail=True)` entry, local or S3."""
    value = info.get("mtime", info.get("LastModified"))
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value) if value is not None else 0.0
