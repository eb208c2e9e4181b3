"""Staging: where owned snapshots live (a local root or `s3://bucket/prefix`), one fsspec code path.

Layout: `<root>/<run>/step_<step:08d>/` holds one snapshot. Invariants:
- a local root must be a real directory of this user (or root), not writable by others without
  the sticky bit (`confined.check_root`): a symlink planted at the root, or another user's root,
  raises `UnsafeStagingRootError` at construction and again at every delete;
- `delete` (and every delete made by `retire`/`put`) is confined to strictly below `root`: a path
  with a `..` segment, a symlink, a local path resolving outside the root, another bucket or
  another prefix raises `StagingPathError` before anything is deleted; the marker goes first so
  readers stop trusting a snapshot that is being removed; local deletes (and the `.retired`
  mark) go through directory descriptors opened without following symlinks
  (`confined.remove_below`), so a symlink swapped in after the check cannot lead out of the root;
- `put` uploads marker-last and refuses an incomplete source (to S3 with a sliding window of
  parts in flight, `s3_upload`);
- `retire(path, owned=False)` never deletes anything (e.g. an `hf` source the trainer owns);
  owned snapshots are marked `.retired` and enter the run's keep-ring: the newest
  `keep_snapshots` retired snapshots (by step) are kept for reruns, older retired ones deleted;
  snapshots not yet retired (points still running) are never touched; `keep_snapshots=0` deletes
  at once;
- best-K retention (`keep_best > 0`): `retire(..., protect=steps)` also keeps every retired
  snapshot whose step is in `protect` (the caller's best K measured steps by a metric,
  `pinned_eval.snapshot.keep_best`); one whose step left `protect` is deleted under the ring rule.
  A retire not told `protect` (None: the janitor's) then marks and deletes nothing;
- `materialize(url)` returns an engine-visible local path: a local snapshot is checked and
  returned as is; an S3 snapshot is checked, downloaded marker-last into a bounded local cache
  (LRU by size; the entry just used is never evicted), and checked again after download.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import os
import posixpath
import re
import shutil
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pinned_eval.durable import replace_durably
from pinned_eval.points import check_run_name, run_key, run_of_key
from pinned_eval.settings import get_settings
from pinned_eval.snapshot import s3_upload
from pinned_eval.snapshot.check import SnapshotCheck, check_snapshot
from pinned_eval.snapshot.confined import StagingPathError as StagingPathError
from pinned_eval.snapshot.confined import UnsafeStagingRootError as UnsafeStagingRootError
from pinned_eval.snapshot.confined import check_root, remove_below, write_below
from pinned_eval.snapshot.errors import ExportError
from pinned_eval.snapshot.layout import MARKER, RETIRED, file_mtime, fsync_path, is_local, is_s3, join, resolve, to_url
from pinned_eval.trusted_paths import UntrustedPathError, make_private_dirs

_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class SnapshotIncompleteError(ExportError, RuntimeError):
    """A snapshot failed its completeness check where a complete one is required."""

    def __init__(self, check: SnapshotCheck) -> None:
        self.check = check
        super().__init__(f"snapshot {check.path} is not complete: {check.problem}: {check.detail}")


@dataclass(frozen=True)
class StagedSnapshot:
    run: str
    step: int
    path: str
    complete: bool
    retired: bool
    mtime: float  # newest file modification time (epoch seconds)


@dataclass(frozen=True)
class RetireResult:
    path: str
    owned: bool
    deleted: list[str]
    kept: list[str]


class Staging:
    def __init__(
        self,
        root: str,
        storage_options: dict[str, Any] | None = None,
        keep_snapshots: int = 2,
        cache_dir: Path | None = None,
        cache_max_bytes: int | None = None,
        keep_best: int = 0,
    ) -> None:
        if keep_snapshots < 0:
            raise ValueError(f"keep_snapshots must be >= 0, got {keep_snapshots}")
        if keep_best < 0:
            raise ValueError(f"keep_best must be >= 0, got {keep_best}")
        if cache_max_bytes is not None and cache_max_bytes < 0:
            raise ValueError(f"cache_max_bytes must be >= 0, got {cache_max_bytes}")
        self.storage_options = dict(storage_options or {})
        self.fs, root_path = resolve(root, self.storage_options)
        self.local = is_local(self.fs)
        if self.local:
            check_root(os.path.abspath(root_path))
            root_path = os.path.realpath(root_path)
        elif not root_path.strip("/"):
            raise StagingPathError(f"staging root {root!r} names no bucket")
        self.root_path = root_path
        self.root = to_url(self.fs, root_path)
        self.keep_snapshots = keep_snapshots
        self.keep_best = keep_best
        self.cache_dir = Path(cache_dir) if cache_dir else get_settings().home / "snapshot-cache"
        self.cache_max_bytes = cache_max_bytes

    # ---- paths -------------------------------------------------------------------------------

    def path_for(self, run: str, step: int) -> str:
        """`<root>/<run_key(run)>/step_<step, 8 digits>`: one directory per run, whatever the case."""
        try:
            check_run_name(run)
        except ValueError as exc:
            raise StagingPathError(str(exc)) from None
        if step < 0:
            raise StagingPathError(f"step must be >= 0, got {step}")
        return to_url(self.fs, join(self.fs, self.root_path, f"{run_key(run)}/step_{step:08d}"))

    def _confine(self, path: str) -> str:
        """The fs path of `path` if it lies strictly below the root; raise before any delete."""
        if any(seg == ".." for seg in re.split(r"[/\\]", path)):
            raise StagingPathError(f"{path!r} contains a '..' segment")
        if self.local:
            if "://" in path and not path.startswith("file://"):
                raise StagingPathError(f"{path!r} is not on the local staging root {self.root}")
            raw = path.removeprefix("file://")
            if not os.path.isabs(raw):
                raise StagingPathError(f"{path!r} is not an absolute path under {self.root}")
            if os.path.islink(raw.rstrip(os.sep)):
                raise StagingPathError(f"{path!r} is a symlink; staging deletes only real directories")
            real = os.path.realpath(raw)
            if not real.startswith(self.root_path + os.sep):
                raise StagingPathError(f"{path!r} resolves to {real!r}, outside staging root {self.root}")
            return real
        if not path.startswith(("s3://", "s3a://")):
            raise StagingPathError(f"{path!r} is not an s3:// URL under staging root {self.root}")
        fs_path = posixpath.normpath(path.split("://", 1)[1])
        if fs_path.split("/", 1)[0] != self.root_path.split("/", 1)[0]:
            raise StagingPathError(f"{path!r} is in another bucket than staging root {self.root}")
        if not fs_path.startswith(self.root_path + "/"):
            raise StagingPathError(f"{path!r} is outside staging root {self.root}")
        return fs_path

    def _below(self, fs_path: str) -> builtins.list[str]:
        """The components of a confined local path below the root."""
        return fs_path[len(self.root_path) + 1 :].split(os.sep)

    def _run_step(self, fs_path: str) -> tuple[str, int]:
        rel = fs_path[len(self.root_path) + 1 :].replace(os.sep, "/")
        parts = rel.split("/")
        m = _STEP_DIR.match(parts[-1]) if len(parts) == 2 else None
        run = run_of_key(parts[0]) if m else None
        if not m or run is None:
            raise StagingPathError(f"{rel!r} is not <run>/step_<step> under staging root {self.root}")
        return run, int(m.group(1))

    # ---- snapshots ---------------------------------------------------------------------------

    def check(self, path: str, *, require_marker: bool = True) -> SnapshotCheck:
        return check_snapshot(path, self.storage_options, require_marker=require_marker)

    def put(self, local_dir: str | Path, run: str, step: int) -> str:
        """Copy/upload a complete local snapshot to `path_for(run, step)`, marker last."""
        src = os.path.realpath(local_dir)
        result = check_snapshot(src)
        if not result.complete:
            raise SnapshotIncompleteError(result)
        dest = self.path_for(run, step)
        fs_dest = self._confine(dest)
        if self.local and src == fs_dest:
            return dest
        if self.fs.exists(fs_dest):
            self.delete(dest)
        names = sorted(n for n in os.listdir(src) if os.path.isfile(os.path.join(src, n)) and n != MARKER)
        if self.local:  # 0700, below trusted directories only (a run dir a neighbour made in a shared root: refused)
            try:
                make_private_dirs(fs_dest, "staging path")
            except UntrustedPathError as exc:
                raise StagingPathError(str(exc)) from None
        try:
            pairs = [(os.path.join(src, n), join(self.fs, fs_dest, n)) for n in names]
            if is_s3(self.fs):
                s3_upload.put_files(self.fs, pairs)
            else:  # local, or any other fsspec store
                self.fs.put([lp for lp, _ in pairs], [rp for _, rp in pairs])
                if self.local:  # durable before the marker vouches for them
                    for _, rp in pairs:
                        fsync_path(rp)
                    fsync_path(fs_dest)
            self.fs.put_file(os.path.join(src, MARKER), join(self.fs, fs_dest, MARKER))
        except BaseException:
            with contextlib.suppress(OSError):
                self.delete(dest)
            raise
        return dest

    def list(self, run: str | None = None) -> builtins.list[StagedSnapshot]:
        """Every `<run>/step_*` snapshot under the root (optionally one run's), oldest step first."""
        keys = [run_key(run)] if run is not None else [n for n, t in self._children(self.root_path) if t != "file"]
        found = []
        for key in keys:
            if (r := run_of_key(key)) is None:
                continue
            for name, kind in self._children(join(self.fs, self.root_path, key)):
                m = _STEP_DIR.match(name)
                if kind != "directory" or not m:
                    continue
                fs_path = join(self.fs, self.root_path, f"{key}/{name}")
                files = self.fs.ls(fs_path, detail=True)
                mtime = max((file_mtime(f) for f in files), default=0.0)
                retired = any(f["name"].rstrip("/").endswith("/" + RETIRED) for f in files)
                url = to_url(self.fs, fs_path)
                complete = self.check(url).complete
                found.append(StagedSnapshot(r, int(m.group(1)), url, complete, retired, mtime))
        return sorted(found, key=lambda s: (s.run, s.step))

    def _children(self, fs_path: str) -> builtins.list[tuple[str, str]]:
        try:
            entries = self.fs.ls(fs_path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [(e["name"].rstrip("/").rsplit("/", 1)[-1], e["type"]) for e in entries]

    def delete(self, path: str) -> None:
        """Delete one snapshot strictly below the root: marker first, then everything else."""
        fs_path = self._confine(path)
        if self.local:  # through directory descriptors, never following a symlink
            remove_below(self.root_path, self._below(fs_path), first=MARKER)
            return
        # Two points of one run may retire at once and race to delete the same old snapshot.
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(join(self.fs, fs_path, MARKER))
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(fs_path, recursive=True)

    def retire(self, path: str, owned: bool, protect: frozenset[int] | None = None) -> RetireResult:
        """The point is done with `path`: keep it in the run's keep-ring or delete it (if owned).

        `protect`: steps whose retired snapshots stay beyond the ring (best-K retention)."""
        if not owned:
            return RetireResult(path, owned=False, deleted=[], kept=[path])
        fs_path = self._confine(path)
        run, _ = self._run_step(fs_path)
        if self.keep_snapshots == 0 and not self.keep_best:
            self.delete(path)
            return RetireResult(path, owned=True, deleted=[path], kept=[])
        stamp = datetime.now(UTC).isoformat().encode()
        if self.local:  # a failed export may have left nothing to keep
            write_below(self.root_path, self._below(fs_path), RETIRED, stamp)
        elif self.fs.exists(fs_path):
            self.fs.pipe_file(join(self.fs, fs_path, RETIRED), stamp)
        ring = sorted((s for s in self.list(run) if s.retired), key=lambda s: s.step, reverse=True)
        if self.keep_best and protect is None:  # which steps are best is unknown here: delete nothing
            return RetireResult(path, owned=True, deleted=[], kept=[s.path for s in ring])
        protected = protect or frozenset()
        kept = [s for i, s in enumerate(ring) if i < self.keep_snapshots or s.step in protected]
        deleted = [s for s in ring if s not in kept]
        for s in deleted:
            self.delete(s.path)
        return RetireResult(path, owned=True, deleted=[s.path for s in deleted], kept=[s.path for s in kept])

    # ---- local materialization ---------------------------------------------------------------

    def materialize(self, url: str, storage_options: dict[str, Any] | None = None) -> Path:
        """An engine-visible local directory holding the complete snapshot at `url` (read with
        `storage_options`, default the root's: a checkpoint outside staging may need its own)."""
        options = self.storage_options if storage_options is None else storage_options
        fs, fs_path = resolve(url, options)
        remote = check_snapshot(url, options)
        if not remote.complete:
            raise SnapshotIncompleteError(remote)
        if is_local(fs):
            return Path(fs_path)
        make_private_dirs(str(self.cache_dir), "snapshot cache")  # 0700: others may not read or swap weights
        self._clean_abandoned_tmp()
        marker = fs.cat_file(join(fs, fs_path, MARKER))
        digest = hashlib.sha256(url.encode()).hexdigest()[:12]
        entry = self.cache_dir / f"{'-'.join(fs_path.split('/')[-2:])}-{digest}"
        if not self._cached(entry, marker):
            tmp = self.cache_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                self._download(fs, fs_path, tmp)
                if not self._cached(entry, marker):  # another process may have won the race
                    if entry.exists():
                        shutil.rmtree(entry)
                    replace_durably(tmp, entry)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        os.utime(entry)  # last use, for LRU eviction
        self._evict(keep=entry)
        return entry

    def _cached(self, entry: Path, marker: bytes) -> bool:
        local_marker = entry / MARKER
        if not (local_marker.is_file() and local_marker.read_bytes() == marker):
            return False
        return check_snapshot(str(entry)).complete

    def _download(self, fs: Any, fs_path: str, tmp: Path) -> None:
        tmp.mkdir()
        names = sorted(n for n, t in _ls_files(fs, fs_path) if n != MARKER)
        fs.get([join(fs, fs_path, n) for n in names], [str(tmp / n) for n in names])
        fs.get_file(join(fs, fs_path, MARKER), str(tmp / MARKER))
        local = check_snapshot(str(tmp))
        if not local.complete:
            raise SnapshotIncompleteError(local)

    def _clean_abandoned_tmp(self) -> None:
        for d in self.cache_dir.glob(".tmp-*"):
            pid = d.name.split("-")[1]
            if pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)

    def _evict(self, keep: Path) -> None:
        if self.cache_max_bytes is None:
            return
        entries = [(d.stat().st_mtime, _dir_bytes(d), d) for d in self.cache_dir.iterdir()
                   if d.is_dir() and not d.name.startswith(".")]
        total = sum(size for _, size, _ in entries)
        for _, size, d in sorted(entries):
            if total <= self.cache_max_bytes:
                break
            if d != keep:
                shutil.rmtree(d, ignore_errors=True)
                total -= size


def _ls_files(fs: Any, fs_path: str) -> builtins.list[tuple[str, str]]:
    return [(e["name"].rstrip("/").rsplit("/", 1)[-1], e["type"]) for e in fs.ls(fs_path, detail=True)
            if e["type"] == "file"]


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
