"""Deletes and writes strictly below a local staging root, through directory file descriptors.

Invariants (a hostile local user shares the node and may own files near the root):
- a staging root is trusted only when it is a real directory (not a symlink), owned by this
  process's user (or root), and not writable by its group or others unless the sticky bit is set,
  and every directory on the way to it is trusted by the same rule (`pinned_eval.trusted_paths`:
  a neighbour's symlink or directory higher up is refused, not followed); `check_root` refuses
  anything else with `UnsafeStagingRootError` naming the root, the component and why, at
  construction and again before every delete or write;
- every delete and write opens the root with `O_NOFOLLOW`, re-checks it on the open descriptor,
  and walks down one component at a time with `O_NOFOLLOW` relative to the parent's descriptor
  (`dir_fd`), so a symlink swapped in after the path check (at the root or at any component
  below it) makes the call fail with `StagingPathError` instead of following it out of the root;
- the tree itself is removed by `shutil.rmtree(name, dir_fd=parent)`, the stdlib's descriptor
  walk that never follows a symlink and re-checks each directory it enters (same inode), so
  nothing outside the root is ever unlinked.
Local paths only; S3 has no symlinks (its confinement is the key prefix check in `staging`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator, Sequence

from pinned_eval.trusted_paths import untrusted_component, why_untrusted

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class StagingPathError(ValueError):
    """A path given to staging lies outside its root (or is not a snapshot path of it)."""


class UnsafeStagingRootError(StagingPathError):
    """The staging root is a symlink, another user's, or writable by others without the sticky bit."""


def _why_unsafe(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    return why_untrusted(st)


def _check_ancestors(root: str) -> None:
    found = untrusted_component(os.path.dirname(os.path.abspath(root)))
    if found is not None:
        entry, why = found
        raise UnsafeStagingRootError(f"staging root {root!r} refused ({entry!r} on the way to it): {why}")


def check_root(root: str) -> None:
    """Refuse a local staging root that another user could redirect or fill: the root itself
    when it exists, and every directory on the way to it; a root that does not exist yet passes
    when its ancestors do (this user creates it; every delete re-checks it)."""
    _check_ancestors(root)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return
    why = _why_unsafe(st)
    if why is not None:
        target = f" (to {os.readlink(root)!r})" if stat.S_ISLNK(st.st_mode) else ""
        raise UnsafeStagingRootError(f"staging root {root!r} refused: {why}{target}")


@contextlib.contextmanager
def _open_dir(name: str, dir_fd: int | None, shown: str) -> Iterator[int]:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StagingPathError(f"{shown!r} is a symlink or not a directory; staging never follows it") from None
        raise
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _open_root(root: str) -> Iterator[int]:
    _check_ancestors(root)
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # replaced since construction
            raise UnsafeStagingRootError(f"staging root {root!r} refused: it is a symlink or not a directory") from None
        raise
    try:
        why = _why_unsafe(os.fstat(fd))
        if why is not None:
            raise UnsafeStagingRootError(f"staging root {root!r} refused: {why}")
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _open_parent(root: str, parts: Sequence[str]) -> Iterator[int]:
    """The descriptor of `root/parts[:-1]`, walked without following any symlink."""
    if not parts or any(p in ("", ".", "..") or os.sep in p for p in parts):
        raise StagingPathError(f"{parts!r} is not a path strictly below staging root {root!r}")
    with contextlib.ExitStack() as stack:
        fd = stack.enter_context(_open_root(root))
        for i, part in enumerate(parts[:-1]):
            fd = stack.enter_context(_open_dir(part, fd, os.path.join(root, *parts[: i + 1])))
        yield fd


def before_delete(parent_fd: int, name: str) -> None:
    """Seam between the last component's check and its removal (tests inject a swap here)."""


def remove_below(root: str, parts: Sequence[str], first: str | None = None) -> None:
    """Remove `root/parts...` (a file or a whole tree); `first` (the marker) goes before the rest.

    Missing is not an error (two retirers may race); a symlink anywhere on the way raises
    `StagingPathError` and removes nothing below it.
    """
    shown = os.path.join(root, *parts)
    try:
        with _open_parent(root, parts) as parent:
            name = parts[-1]
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise StagingPathError(f"{shown!r} is a symlink; staging deletes only real directories")
            if not stat.S_ISDIR(st.st_mode):
                before_delete(parent, name)
                os.unlink(name, dir_fd=parent)
                return
            if first is not None:
                with _open_dir(name, parent, shown) as target, contextlib.suppress(FileNotFoundError):
                    os.unlink(first, dir_fd=target)
            before_delete(parent, name)
            if not _is_real_dir(parent, name):  # rmtree would raise a bare OSError on a symlink
                raise StagingPathError(f"{shown!r} became a symlink; staging never follows it")
            shutil.rmtree(name, dir_fd=parent)
    except FileNotFoundError:
        return


def _is_real_dir(parent: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return True  # gone: rmtree raises FileNotFoundError, which the caller takes as done


def write_below(root: str, parts: Sequence[str], name: str, data: bytes) -> bool:
    """Write `data` to `root/parts.../name` (replacing it); False when the directory is gone."""
    try:
        with _open_parent(root, [*parts, name]) as d:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=d)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
    except FileNotFoundError:
        return False
    return True
