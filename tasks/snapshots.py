"""Snapshot tasks: export a point's source into staging, check completeness, retire.

Contract:
- `export_snapshot` turns a `SnapshotSource` into a `Snapshot`: `hf` is reused as is (never
  owned, never deleted); `staged` is adopted (it must be this point's staging path); `megatron`
  and `state_dict` are converted into `staging.path_for(run, step)`; `lora` (a PEFT adapter + its
  base) is copied there as an adapter snapshot (fleet `lora_mode` "adapter"; an adapter already
  staged there is adopted) or merged into its base as a full snapshot ("merged"). A storage or
  converter failure (`pinned_eval.snapshot.errors.EXPORT_ERRORS`) removes what it wrote and raises
  `EvalSkipped(EXPORT_FAILED)`; any other error also removes it, then propagates (the point fails).
- `check_snapshot_task` reads headers only (an adapter snapshot is checked as one: config and
  `adapter_model.safetensors`, never as a full model) and raises `EvalSkipped(CKPT_MISSING)` with the
  typed problem (missing marker, truncated shard, ...; a base checkpoint without a marker gets
  every structural check but the marker's), reading S3 with the staging block's endpoint and
  credentials (also for `hf` sources on S3); an S3 snapshot is then materialized
  into the engine-visible local cache and `Snapshot.local_path` is set.
- `retire_snapshot` runs in the flow's `finally` and the `on_crashed` hook: owned snapshots
  enter the run's keep-ring (the retired snapshots of `protect`'s steps, the run's best K, stay
  beyond it), anything else is left alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.points import LoraMode, SnapshotSource, SourceKind
from pinned_eval.skips import EvalSkipped, SkipReason
from pinned_eval.snapshot.check import check_snapshot
from pinned_eval.snapshot.errors import EXPORT_ERRORS
from pinned_eval.snapshot.staging import RetireResult, Staging, StagingPathError


class Snapshot(BaseModel):
    """The snapshot a point measures, and whether the point owns it."""

    model_config = ConfigDict(frozen=True)

    path: str = Field(description="Directory or s3:// URL of the snapshot.")
    owned: bool = Field(description="True when this point must retire it.")
    kind: SourceKind
    require_marker: bool = True
    export_time_seconds: float | None = None
    local_path: str | None = Field(default=None, description="Engine-visible directory (after check).")
    adapter: bool = Field(default=False, description="A LoRA adapter served over `lora_base` (adapter mode).")
    lora_base: str | None = Field(default=None, description="Base HF dir the fleet keeps (adapter mode).")


@task(cache_policy=NO_CACHE, task_run_name="export-{source.kind}")
def export_snapshot(
    source: SnapshotSource, run: str, step: int, staging: Staging, lora_mode: LoraMode = "adapter"
) -> Snapshot:
    logger = get_run_logger()
    if source.kind is SourceKind.HF:
        return Snapshot(path=source.path, owned=False, kind=source.kind, require_marker=source.require_marker)
    dest = staging.path_for(run, step)
    if source.kind is SourceKind.STAGED:
        if source.path.rstrip("/") != dest.rstrip("/"):
            raise EvalSkipped(
                SkipReason.EXPORT_FAILED,
                f"staged snapshot {source.path!r} is not this point's staging path {dest!r}",
            )
        return Snapshot(path=dest, owned=True, kind=source.kind)
    started = time.monotonic()
    try:
        if source.kind is SourceKind.MEGATRON:
            from pinned_eval.snapshot.megatron import export_megatron_checkpoint  # torch: only a conversion needs it

            assert source.hf_base is not None  # validated by SnapshotSource
            export_megatron_checkpoint(
                source.path, source.hf_base, dest, storage_options=staging.storage_options
            )
        elif source.kind is SourceKind.LORA:
            assert source.hf_base is not None
            _export_lora(source.path, source.hf_base, dest, staging, lora_mode)
        else:
            from pinned_eval.snapshot.state_dict import export_state_dict  # torch: only a conversion needs it

            assert source.hf_base is not None
            export_state_dict(source.path, source.hf_base, dest, storage_options=staging.storage_options)
    except EvalSkipped:  # a missing or truncated adapter source: ckpt_missing, named
        staging.delete(dest)
        raise
    except EXPORT_ERRORS as exc:  # storage or converter failure: this point's export_failed skip
        logger.exception("export of %s %s failed", source.kind, source.path)
        staging.delete(dest)
        raise EvalSkipped(SkipReason.EXPORT_FAILED, f"{source.kind} export failed: {exc}") from exc
    except Exception:  # a bug or a bad configuration fails the point loudly, leaving nothing partial
        staging.delete(dest)
        raise
    seconds = time.monotonic() - started
    logger.info("exported %s %s to %s in %.2fs", source.kind, source.path, dest, seconds)
    adapter = source.kind is SourceKind.LORA and lora_mode == "adapter"
    return Snapshot(
        path=dest, owned=True, kind=source.kind, export_time_seconds=seconds, adapter=adapter,
        lora_base=source.hf_base if adapter else None,
    )


def _export_lora(adapter: str, base: str, dest: str, staging: Staging, mode: LoraMode) -> None:
    """Adapter mode: the adapter alone, marker last (a staged adapter at `dest` is adopted as is);
    merged mode: base + adapter merged into a full snapshot at `dest`, marker last. The source is
    checked first like any snapshot (its marker required only when the trainer staged it at `dest`);
    a source outside staging must be a local directory."""
    from pinned_eval.snapshot.lora import export_merged, write_adapter_snapshot

    staged = adapter.rstrip("/") == dest.rstrip("/")
    options = staging.storage_options if staged else None
    source = check_snapshot(adapter, options, require_marker=staged, adapter=True)
    if not source.complete:  # a missing or truncated adapter file is a missing checkpoint, named
        raise EvalSkipped(SkipReason.CKPT_MISSING, f"adapter {adapter}: {source.problem}: {source.detail}")
    if mode == "merged":
        export_merged(adapter, base, dest, storage_options=staging.storage_options)
    elif not staged:
        write_adapter_snapshot(adapter, dest, storage_options=staging.storage_options)


@task(cache_policy=NO_CACHE, task_run_name="check")
def check_snapshot_task(snapshot: Snapshot, staging: Staging, s3_options: dict[str, Any] | None = None) -> Snapshot:
    """`s3_options`: how to read an `s3://` snapshot that is not staging's own (an `hf` source),
    the staging block's endpoint and credentials; an owned one is read with staging's options."""
    remote = snapshot.path.startswith(("s3://", "s3a://"))
    options = staging.storage_options if snapshot.owned else (s3_options if remote else None)
    result = check_snapshot(snapshot.path, options, require_marker=snapshot.require_marker, adapter=snapshot.adapter)
    if not result.complete:
        raise EvalSkipped(SkipReason.CKPT_MISSING, f"{snapshot.path}: {result.problem}: {result.detail}")
    local = staging.materialize(snapshot.path, options) if remote else Path(snapshot.path)
    return snapshot.model_copy(update={"local_path": str(local)})


@task(cache_policy=NO_CACHE, task_run_name="retire")
def retire_snapshot(snapshot: Snapshot, staging: Staging, protect: frozenset[int] | None = None) -> RetireResult:
    try:
        result = staging.retire(snapshot.path, owned=snapshot.owned, protect=protect)
    except StagingPathError as exc:
        # never delete outside staging; the refusal is logged and the point's outcome stands
        get_run_logger().error("refused to retire %s: %s", snapshot.path, exc)
        return RetireResult(snapshot.path, owned=snapshot.owned, deleted=[], kept=[snapshot.path])
    if result.deleted:
        get_run_logger().info("retired; deleted %s, kept %s", result.deleted, result.kept)
    return result
