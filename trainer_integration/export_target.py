"""Where a trainer's in-loop exports go: `<staging_root>/<run>/step_<step:08d>`, local or S3.

Contract:
- `ExportTarget(root, storage_options)`: explicit `storage_options` are used as given. An `s3://`
  root without them is written with the saved staging block's endpoint and credentials, read by
  `fetch(rest, block_name)` over the API (a block naming a prefect-aws `S3Bucket`: that block's,
  `pinned_eval.aws_bucket`). The client calls `fetch` from its admission thread
  (until it succeeds), never on the training loop's thread.
- `staging()` is the `Staging` exports write into (None without a root). Before the block's
  credentials were read it raises `ApiUnavailableError` (that point is `export_failed`, the loop
  goes on); when the block does not exist it raises `ValueError` naming `staging_root` (a
  configuration error fails loudly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pinned_eval.aws_bucket import S3_BUCKET_SLUG, s3_bucket_location
from pinned_eval.snapshot.layout import s3_storage_options
from pinned_eval.snapshot.staging import Staging
from trainer_integration.events import STAGING_BLOCK_SLUG
from trainer_integration.rest import ApiUnavailableError, PrefectRest


class ExportTarget:
    def __init__(self, root: str | Path | None, storage_options: dict[str, Any] | None) -> None:
        self.root = str(root) if root is not None else None
        self._options = storage_options
        self._from_block = self.root is not None and self.root.startswith(("s3://", "s3a://")) and not storage_options
        self._missing: str | None = None
        self._store: Staging | None = None

    @property
    def wants_block(self) -> bool:
        """Whether the staging block's credentials are still to be read."""
        return self._from_block and self._options is None

    def fetch(self, rest: PrefectRest, block: str) -> None:
        """Read the staging block's S3 endpoint and keys (network I/O: the admission thread)."""
        data = rest.block_data(STAGING_BLOCK_SLUG, block, include_secrets=True)
        if data is None:
            self._missing = (
                f"staging_root: {self.root} is on S3 but the staging block {block!r} does not exist; "
                "save it or pass storage_options"
            )
            return
        self._missing = None
        if data.get("s3_bucket_block"):  # the staging block names a prefect-aws S3Bucket: its credentials
            name = str(data["s3_bucket_block"])
            bucket = rest.block_data(S3_BUCKET_SLUG, name, include_secrets=True)
            try:
                if bucket is None:
                    raise ValueError(f"the staging block {block!r} names S3Bucket {name!r}, which does not exist")
                self._options = s3_bucket_location(bucket, "s3_bucket_block", name)[1]
            except ValueError as exc:  # a configuration error: `staging()` raises it, naming staging_root
                self._missing = f"staging_root: {exc}"
            return
        self._options = s3_storage_options(
            data.get("endpoint_url"), data.get("region_name"), data.get("aws_access_key_id"),
            data.get("aws_secret_access_key"),
        )

    def staging(self) -> Staging | None:
        if self.root is None:
            return None
        if self._store is None:
            if self.wants_block:
                if self._missing:
                    raise ValueError(self._missing)
                raise ApiUnavailableError(f"staging_root: the staging block's S3 credentials for {self.root} "
                                          "are not read yet (Prefect API unreachable)")
            self._store = Staging(self.root, storage_options=self._options)
        return self._store
