"""What `pinned-eval request` checks before anything is sent; each refusal is exit 2 naming the flag.

- `parse_source`: `--source KIND:PATH` with KIND a `SourceKind`; local paths made absolute here,
  where the user typed them (`absolute`).
- `check_local_paths`: a local `--source`/`--hf-base` path exists and holds no NUL byte.
- `check_source_roots`: the source lies under the staging block's root or one of its source roots
  (the flow would refuse it unread); an S3Bucket-backed staging block's root is that bucket's URL.
- `check_blocks`: the four blocks the point loads (`BLOCK_FLAGS`) are saved on the server.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pydantic import ValidationError

from app.commands._cli import fail
from app.commands.errors import human_errors
from pinned_eval.events import BlockNames
from pinned_eval.points import SnapshotSource, SourceKind

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

SOURCE_KINDS = ", ".join(k.value for k in SourceKind)  # --help and the errors say the same
# the flag naming each block a point loads, and that block's type slug
BLOCK_FLAGS = {"suite": "pinned-eval-suite", "fleet": "pinned-eval-fleet", "staging": "pinned-eval-staging",
               "sinks": "pinned-eval-sinks"}
SOURCE_FLAGS = {"kind": "--source", "path": "--source", "hf_base": "--hf-base", "source": "--source"}
REQUEST_FLAGS = {**SOURCE_FLAGS, "run": "--run", "step": "--step", "max_in_flight": "--max-in-flight",
                 "policy": "--policy", "posture": "--posture", **{b: f"--{b}" for b in BLOCK_FLAGS}}


def parse_source(text: str, hf_base: str | None) -> SnapshotSource:
    """`KIND:PATH` (e.g. `staged:/stage/exp42/step_00000120`, `hf:s3://b/p`) → a validated source
    (exit 2 naming the flag when it is not one)."""

    kind, sep, path = text.partition(":")
    if not sep or not path or kind not in {k.value for k in SourceKind}:
        fail(f"--source: {text!r} must be KIND:PATH with KIND one of {SOURCE_KINDS}", 2)
    try:
        return SnapshotSource(kind=kind, path=absolute(path), hf_base=absolute(hf_base))  # type: ignore[arg-type]
    except ValidationError as exc:
        fail(human_errors(exc, SOURCE_FLAGS), 2)


def absolute(path: str | None) -> str | None:
    """A local path made absolute here, where the user typed it (the worker runs in another
    directory); URLs and None unchanged. Symlinks are kept (the worker's root check resolves them)."""
    if path is None or "://" in path or "\x00" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def check_source_roots(client: SyncPrefectClient, source: SnapshotSource, staging: str) -> None:
    """Exit 2 when `source` lies outside the staging block's source roots (the flow would refuse it
    unread), before anything is sent; the message says how to declare a root."""
    from pinned_eval.source_roots import SourceOutsideRoots, check_within_roots

    doc = client.read_block_document_by_name(staging, BLOCK_FLAGS["staging"], include_secrets=False)
    root = doc.data.get("root")
    if doc.data.get("s3_bucket_block"):  # a prefect-aws S3Bucket names the root (its bucket and folder)
        from prefect.exceptions import ObjectNotFound

        from pinned_eval.aws_bucket import S3_BUCKET_SLUG, s3_bucket_url

        name = str(doc.data["s3_bucket_block"])
        try:
            bucket = client.read_block_document_by_name(name, S3_BUCKET_SLUG, include_secrets=False)
        except ObjectNotFound:
            fail(f"--staging: staging block {staging!r} names the S3Bucket block {name!r}, which does not exist; "
                 "nothing was sent", 2)
        root = s3_bucket_url(bucket.data)
    roots = [str(root), *map(str, doc.data.get("source_roots") or [])]
    for flag, path in (("--source", source.path), ("--hf-base", source.hf_base)):
        if path is None:
            continue
        try:
            check_within_roots(path, roots, flag)
        except SourceOutsideRoots:
            fail(f"{flag}: {path} is outside the source roots of staging block {staging!r} ({', '.join(roots)}); "
                 "nothing was sent. Move the checkpoint under one of them, or declare its directory: "
                 "`source_root:` in pinned-eval.yaml then `pinned-eval block apply pinned-eval.yaml`, or "
                 f"`pinned-eval block save staging {staging} --root ROOT --source-root DIR --overwrite`", 2)


def check_local_paths(source: SnapshotSource) -> None:
    """Exit 2 when a local path of `source` does not exist (URLs are the worker's to read)."""
    for flag, path in (("--source", source.path), ("--hf-base", source.hf_base)):
        if path and "\x00" in path:
            fail(f"{flag}: a path cannot contain a NUL byte; nothing was sent", 2)
        if path and "://" not in path and not os.path.exists(path):
            fail(f"{flag}: {path} does not exist; nothing was sent", 2)


def block_exists(client: SyncPrefectClient, kind: str, name: str) -> bool:
    """Whether a `kind` block (a key of `BLOCK_FLAGS`) named `name` is saved on the server."""
    from prefect.exceptions import ObjectNotFound  # prefect: slow import; `pinned-eval --help` stays fast

    try:
        client.read_block_document_by_name(name, BLOCK_FLAGS[kind], include_secrets=False)
    except ObjectNotFound:
        return False
    return True


def check_blocks(client: SyncPrefectClient, blocks: BlockNames) -> None:
    """Exit 2, naming every flag whose block is not saved on the server, before anything is sent."""
    missing = [f"--{kind}: no {slug} block named {getattr(blocks, kind)!r}" for kind, slug in BLOCK_FLAGS.items()
               if not block_exists(client, kind, getattr(blocks, kind))]
    if missing:
        fail("; ".join(missing) + "; nothing was sent. Save the blocks first (`pinned-eval block save --help`), "
             "or name saved ones", 2)

