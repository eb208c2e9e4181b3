"""Staging block: where snapshots the orchestrator owns live — a local root or `s3://bucket/prefix`.

Invariants: every delete is confined to `root`; a point reads its source only under `root` or
`source_roots` (`pinned_eval.source_roots`); S3 credentials are secret fields, never flow
parameters; `keep_snapshots` owned snapshots per run survive for reruns (the keep-ring);
with `keep_best` > 0 the snapshots of the run's best `keep_best` measured steps by
`keep_best_metric` (read from the sinks block's JSONL file) survive beside the ring.
The S3 root comes either from `root` and this block's own S3 fields, or from a prefect-aws
`S3Bucket` block named by `s3_bucket_block` (`blocks._aws`: bucket and folder as the root, its
`AwsCredentials` as the options), never both: either way the same `Staging` and s3fs options.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect.blocks.core import Block
from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator

from blocks._aws import require_prefect_aws, resolve_s3_bucket
from blocks._meta import DOCS_URL, LOGO_URL
from pinned_eval.sinks import Ledger
from pinned_eval.snapshot.keep_best import KeepBestMode, best_steps
from pinned_eval.snapshot.layout import s3_storage_options
from pinned_eval.snapshot.staging import Staging


class StagingBlock(Block):
    """Snapshot staging on local disk (tmpfs recommended) or S3, with a keep-ring for reruns."""

    _block_type_name = "pinned-eval Staging"
    _block_type_slug = "pinned-eval-staging"
    _logo_url = LOGO_URL
    _documentation_url = DOCS_URL
    _description = "Local or S3 staging for eval snapshots, with a keep-ring and a bounded local cache."
    _code_example = """
    from blocks import StagingBlock

    staging = StagingBlock.load("BLOCK_NAME")
    print(staging.root_url(), staging.keep_snapshots)
    """

    root: str | None = Field(
        default=None,
        description="Local directory or `s3://bucket/prefix` that holds owned snapshots (or set `s3_bucket_block`).",
    )
    s3_bucket_block: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "Name of a saved prefect-aws `S3Bucket` block (with its `AwsCredentials`) whose bucket and folder are "
            "the root, instead of `root` and the S3 fields here (needs `pinned-eval[aws]`)."
        ),
    )
    keep_snapshots: int = Field(
        default=2, ge=0, le=1000, description="Owned snapshots kept per run after their point settles."
    )
    keep_best: int = Field(
        default=0, ge=0, le=1000, description="Also keep the snapshots of the run's best K measured steps (0: off)."
    )
    keep_best_metric: str | None = Field(
        default=None, min_length=1, description="Metric ranking the steps for `keep_best`, e.g. `eval/gsm8k`."
    )
    keep_best_mode: KeepBestMode = Field(default="max", description="`max`: highest value is best; `min`: lowest.")
    endpoint_url: str | None = Field(default=None, description="S3 endpoint URL (MinIO, moto, ...).")
    region_name: str | None = Field(default=None, description="S3 region.")
    aws_access_key_id: SecretStr | None = Field(default=None, description="S3 access key id.")
    aws_secret_access_key: SecretStr | None = Field(default=None, description="S3 secret access key.")
    cache_dir: str | None = Field(
        default=None, description="Engine-visible local cache that S3 snapshots are materialized into."
    )
    cache_max_bytes: int | None = Field(
        default=None, ge=0, description="Bound of the local cache; least recently used snapshots go first."
    )
    source_roots: list[str] = Field(
        default_factory=list,
        description=(
            "Absolute directories or `s3://bucket/prefix` URLs a point's source (`path`, `hf_base`) may lie "
            "under, besides `root`; a source elsewhere (after resolving symlinks) is refused."
        ),
    )

    @field_validator("source_roots")
    @classmethod
    def _absolute_roots(cls, roots: list[str]) -> list[str]:
        for i, root in enumerate(roots):
            if not (root.startswith(("s3://", "s3a://")) or os.path.isabs(root)):
                raise ValueError(f"source_roots[{i}]: {root!r} is neither an absolute path nor s3://bucket/prefix")
        return roots

    _s3: tuple[str, dict[str, Any]] | None = PrivateAttr(default=None)  # the resolved S3Bucket (holds secrets)

    @model_validator(mode="after")
    def _one_way_to_the_root(self) -> StagingBlock:
        if self.s3_bucket_block is None:
            if self.root is None:
                raise ValueError("root: required: a local directory or s3://bucket/prefix "
                                 "(or name a prefect-aws S3Bucket block in s3_bucket_block)")
            return self
        if self.root is not None:
            raise ValueError("root: set either root or s3_bucket_block (the S3Bucket's bucket and folder), not both")
        for name in ("endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: comes from the S3Bucket block's AwsCredentials when s3_bucket_block "
                                 "is set; unset it")
        require_prefect_aws("s3_bucket_block")
        return self

    def _bucket(self) -> tuple[str, dict[str, Any]]:
        """The S3Bucket block, resolved once (Prefect API) into the root URL and s3fs options."""
        assert self.s3_bucket_block is not None
        if self._s3 is None:
            self._s3 = resolve_s3_bucket(self.s3_bucket_block, "s3_bucket_block")
        return self._s3

    def root_url(self) -> str:
        """Where owned snapshots live: `root`, or the S3Bucket block's `s3://bucket/folder`."""
        return self._bucket()[0] if self.s3_bucket_block else str(self.root)

    @model_validator(mode="after")
    def _keep_best_needs_a_metric(self) -> StagingBlock:
        if self.keep_best > 0 and self.keep_best_metric is None:
            raise ValueError(f"keep_best_metric: required when keep_best > 0 (keep_best={self.keep_best})")
        return self

    def protected_steps(self, run: str, jsonl_path: str | None) -> frozenset[int] | None:
        """The steps `Staging.retire` must keep beyond the ring: the run's best `keep_best` measured
        steps by `keep_best_metric` in the JSONL file; None when `keep_best` is off. Raises
        ValueError naming the field when `keep_best` is on and there is no JSONL file to rank from."""
        if not self.keep_best:
            return None
        if not jsonl_path:
            raise ValueError("keep_best: ranks steps from the sinks block's jsonl_path, which is not set")
        assert self.keep_best_metric is not None  # validated above
        rows = Ledger(jsonl_path).read(run)
        return best_steps(rows, run, self.keep_best_metric, self.keep_best, self.keep_best_mode)

    def all_source_roots(self) -> list[str]:
        """Where a point's source may lie: the staging root, then `source_roots`."""
        return [self.root_url(), *self.source_roots]

    def s3_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for any `s3://` URL a point reads with this block (its root, or an
        `hf` checkpoint the watch evaluator found): endpoint, region and keys, whatever the root
        (the S3Bucket block's, with `s3_bucket_block`)."""
        if self.s3_bucket_block:
            return dict(self._bucket()[1])
        secret = self.aws_secret_access_key
        return s3_storage_options(
            self.endpoint_url,
            self.region_name,
            self.aws_access_key_id.get_secret_value() if self.aws_access_key_id else None,
            secret.get_secret_value() if secret else None,
        )

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for `root` (empty for a local root)."""
        return self.s3_options() if self.root_url().startswith("s3://") else {}

    def staging(self) -> Staging:
        return Staging(
            self.root_url(),
            storage_options=self.storage_options(),
            keep_snapshots=self.keep_snapshots,
            cache_dir=Path(self.cache_dir) if self.cache_dir else None,
            cache_max_bytes=self.cache_max_bytes,
            keep_best=self.keep_best,
        )
