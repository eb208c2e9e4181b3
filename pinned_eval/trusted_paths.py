"""Whole-path trust for every local path the product writes or deletes under (OpenSSH's StrictModes rule).

A hostile local user shares the node. A path is trusted when every directory on the way to it
could only have been changed by this user or root:
- each existing component, from `/` down (ancestors and the path itself), is owned by this
  process's user or root, and is not writable by its group or by others unless it has the sticky
  bit (a sticky directory such as /tmp lets others add entries but never rename or remove ours);
- a symlink on the way is followed only when it is owned by this user or root (its directory was
  checked first); its target is walked by the same rule, so a neighbour's `team -> victim` link
  in a world-writable directory is refused, not followed;
- components that do not exist yet pass: this user creates them, below trusted directories,
  with `make_private_dirs` (mode 0700, whatever the umask).
Because only trusted users can change trusted directories, a check holds until they act: there is
no window for another user between the check and the use.

`claim_new_dir` is the rule for a verb's output directory (`tiny-model --out`, `export --out`):
it must not exist yet (it is then created 0700), or be an empty real directory of this user, or
the verb's own earlier output.
`open_trusted_file` opens a file to read back (results a score is computed from): never through a
symlink, never blocking on a FIFO, refused unless it is a regular file of this user or root that
its group and others cannot write.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

_MAX_LINKS = 40  # as the kernel's MAXSYMLINKS


class UntrustedPathError(ValueError):
    """A path, or a directory on the way to it, that another user could redirect or fill."""


def why_untrusted(st: os.stat_result) -> str | None:
    """Why an entry with this `lstat` result is not this user's alone (None: it is)."""
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid}) or root"
    if stat.S_ISLNK(st.st_mode) or st.st_mode & stat.S_ISVTX:
        return None
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & stat.S_IWOTH:
        return f"it is writable by others without the sticky bit (mode {mode:o})"
    if st.st_mode & stat.S_IWGRP:
        return f"it is writable by its group (gid {st.st_gid}) without the sticky bit (mode {mode:o})"
    return None


def untrusted_component(path: str) -> tuple[str, str] | None:
    """The first component on the way to `path` (itself included) that is not trusted, and why;
    None when every existing component is trusted (see the module docstring)."""
    if "\0" in path:
        return path.replace("\0", "\\0"), "it contains a NUL byte"
    if not os.path.isabs(path):
        path = os.path.join(os.getcwd(), path)
    todo = list(reversed(path.split("/")))
    current = "/"
    why = why_untrusted(os.lstat("/"))
    if why is not None:
        return "/", why
    links = 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current)  # a real directory's parent: already walked
            continue
        entry = os.path.join(current, part)
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            return None  # the rest does not exist yet: created below trusted directories
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (os.geteuid(), 0):
                return entry, f"it is a symlink owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"
            links += 1
            if links > _MAX_LINKS:
                return entry, "too many levels of symlinks"
            target = os.readlink(entry)
            if target.startswith("/"):
                current = "/"
            todo.extend(reversed(target.split("/")))
            continue
        why = why_untrusted(st)
        if why is not None:
            return entry, why
        if not stat.S_ISDIR(st.st_mode) and any(p not in ("", ".") for p in todo):
            return entry, "it is not a directory"
        current = entry
    return None


def check_trusted(path: str, what: str) -> None:
    """Raise `UntrustedPathError` ("<what> <path> refused: <component>: <why>") unless `path` is trusted."""
    found = untrusted_component(path)
    if found is not None:
        entry, why = found
        at = "" if entry == path else f" ({entry!r})"
        raise UntrustedPathError(f"{what} {path!r} refused{at}: {why}")


def make_private_dirs(path: str, what: str) -> None:
    """Check `path` is trusted, then create each missing directory of it with mode 0700."""
    check_trusted(path, what)
    missing = []
    head = os.path.abspath(path)
    while not os.path.lexists(head):
        missing.append(head)
        head = os.path.dirname(head)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass  # another process of this user (trusted directories: no one else) made it
        else:
            os.chmod(d, 0o700, follow_symlinks=False)  # the umask may have taken bits away: never adds
    check_trusted(path, what)


def claim_new_dir(
    path: str, what: str, earlier_output: Callable[[str], bool] | None = None, *, create: bool = True
) -> None:
    """Create output directory `path` (0700) for a verb that fills it, or take one it made before;
    refuse an existing one it did not create: anything but an empty real directory of this user,
    or one `earlier_output(path)` recognises as this verb's earlier output (the verb's own files
    only). An empty value (or `.`), `/`, `/etc`, a symlink, `/proc/self` are all refused, one line
    (`UntrustedPathError`) naming `what` (the flag, e.g. `--out`). `create=False`: check only (a
    writer that creates the directory itself, 0700, and removes it when it fails)."""
    if path.strip() in ("", "."):
        raise UntrustedPathError(f"{what}: an empty value names the current directory; give a new directory")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        (make_private_dirs if create else check_trusted)(path, what)
        return
    except (OSError, ValueError) as exc:
        raise UntrustedPathError(f"{what} {path!r}: cannot be used: {getattr(exc, 'strerror', None) or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedPathError(f"{what} {path!r} already exists as a symlink; give a new directory")
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UntrustedPathError(f"{what} {path!r} already exists and is not this user's directory; "
                                 "give a new directory")
    try:
        empty = not os.listdir(path)
    except OSError:
        empty = False
    if not empty and not (earlier_output is not None and earlier_output(path)):
        raise UntrustedPathError(f"{what} {path!r} already exists and holds files this command did not write; "
                                 "give a new directory")
    check_trusted(path, what)


def open_trusted_file(path: str, what: str) -> int:
    """A read-only descriptor of `path`, refused (`UntrustedPathError`) unless the whole path is
    trusted and `path` is a regular file; never follows a final symlink, never blocks on a FIFO."""
    check_trusted(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise UntrustedPathError(f"{what} {path!r} refused: {exc.strerror}") from None
    st = os.fstat(fd)
    why = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else why_untrusted(st)
    if why is not None:
        os.close(fd)
        raise UntrustedPathError(f"{what} {path!r} refused: {why}")
    return fd


def make_private_dir(path: str, what: str) -> None:
    """`make_private_dirs`, then refuse (`UntrustedPathError`) unless `path` itself is a directory
    only this user can read or enter (mode 0700: what its group and others may not even list)."""
    make_private_dirs(path, what)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or stat.S_IMODE(st.st_mode) & 0o077:
        raise UntrustedPathError(f"{what} {path!r} refused: mode {stat.S_IMODE(st.st_mode):o}, not 0700")
