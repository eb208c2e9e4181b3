"""Source roots: the only places a point reads (converts, unpickles) weights from.

A point request names its snapshot source by path, and whoever can send a request is not trusted
to choose the files the worker opens (a Megatron `.metadata` is a pickle). The operator declares
the roots in the staging block (`StagingBlock.source_roots`; the staging root is always one).

Contract of `confine_source(source, roots)`:
- a local path (`source.path`, `source.hf_base`) is resolved with `os.path.realpath` (every
  symlink and `..`) and must be a resolved root or lie below one: a symlink inside a root that
  points outside is outside;
- an `s3://` (or `s3a://`) URL must lie under an `s3://bucket/prefix` root, on a `/` boundary,
  with no empty, `.` or `..` segment; any other scheme is refused;
- a refusal raises `SourceOutsideRoots` whose message is the user's words: the field, the path,
  the roots and the `source_root` key that adds one (no class name); nothing is opened or read
  (resolving a path only lists links), so a refused source is never unpickled.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pinned_eval.points import SnapshotSource

S3_SCHEMES = ("s3://", "s3a://")


class SourceOutsideRoots(ValueError):
    """A requested source path lies outside every declared source root (the message names the field)."""


def within(path: str, root: str) -> bool:
    """Whether `path` resolves to `root` (resolved) or below it."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip("/") + "/")


def _s3_parts(url: str) -> list[str] | None:
    """`bucket/key...` segments of an s3 URL, or None when a segment is empty, `.` or `..`."""
    rest = url.split("://", 1)[1].rstrip("/")
    parts = rest.split("/")
    return None if any(p in ("", ".", "..") for p in parts) else parts


def _s3_within(url: str, root: str) -> bool:
    parts, base = _s3_parts(url), _s3_parts(root)
    return parts is not None and base is not None and parts[: len(base)] == base


def check_within_roots(path: str, roots: Sequence[str], field: str) -> None:
    """Raise `SourceOutsideRoots` naming `field` unless `path` lies under one of `roots`."""
    if path.startswith(S3_SCHEMES):
        ok = any(_s3_within(path, r) for r in roots if r.startswith(S3_SCHEMES))
        resolved = path
    elif "://" in path:
        ok, resolved = False, path
    else:
        ok = any(within(path, r) for r in roots if "://" not in r)
        resolved = os.path.realpath(path)
    if not ok:
        shown = "" if resolved == path else f" (resolves to {resolved!r})"
        raise SourceOutsideRoots(
            f"{field}: {path!r}{shown} is outside the source roots of the point's staging block "
            f"({', '.join(roots)}); nothing was read. Put the snapshot under one of them, or add a root "
            "with the staging block's `source_root` key (pinned-eval.yaml, `pinned-eval block apply`)"
        )


def confine_source(source: SnapshotSource, roots: Sequence[str]) -> None:
    """Refuse a source whose `path` or `hf_base` lies outside `roots` (see the module docstring)."""
    check_within_roots(source.path, roots, "source.path")
    if source.hf_base is not None:
        check_within_roots(source.hf_base, roots, "source.hf_base")
