"""Durable local renames: a file's data is on disk before its new name, and the name after the rename.

`replace_durably(tmp, dest)` is the last step of every atomic write of the product (the JSONL sink,
the results store, the fleet's key file, the staging cache; the trainer's spool does the same in
`trainer_integration.spool`): it fsyncs `tmp` (a file, or a directory and every file directly in
it), renames it over `dest`, then fsyncs `dest`'s directory, in that order. A crash at any point
leaves either the old `dest` or the whole new one, never a name pointing at unwritten data.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a local file or directory by path (a read-only descriptor is enough on POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """fsync `tmp` (a directory: each regular file in it, then itself), rename it to `dest`, fsync
    `dest`'s directory."""
    if os.path.isdir(tmp):
        for entry in sorted(os.scandir(tmp), key=lambda e: e.name):
            if entry.is_file(follow_symlinks=False):
                fsync_path(entry.path)
    fsync_path(tmp)
    os.replace(tmp, dest)
    fsync_path(Path(dest).parent)
