"""Where a run's results live: `<root>/<run>/step_<step:08d>/{generations,samples}.parquet`.

Invariants:
- paths are built from the run name through the staging layout's mapping (`run_key`, the same
  `<run_key>/step_<step:08d>` directories as `Staging.path_for`), never by joining raw strings: a
  refused run name (a `/`, `..`, a newline) raises `ResultsPathError` before anything is opened,
  and two runs never share a directory, even on a case-folding filesystem (`Exp42` vs `exp42`);
- local files are written 0600 in directories 0700 (created with that mode, whatever the umask),
  through a temporary file renamed into place, so a reader sees a whole file or the previous one;
- an S3 root is written and read with the staging block's endpoint and credentials
  (`StagingBlock.s3_options()`); S3 uploads are whole objects, so readers never see a partial one.
"""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pinned_eval.durable import replace_durably
from pinned_eval.points import run_key
from pinned_eval.snapshot.layout import is_local, join, resolve, to_url

GENERATIONS = "generations.parquet"
SAMPLES = "samples.parquet"


class ResultsPathError(ValueError):
    """A run name or step that cannot name a results directory."""


def step_parts(run: str, step: int) -> tuple[str, str]:
    """The two path components of (run, step) below the root, as staging names them."""
    try:
        key = run_key(run)
    except ValueError as exc:
        raise ResultsPathError(str(exc)) from None
    if step < 0:
        raise ResultsPathError(f"step must be >= 0, got {step}")
    return key, f"step_{step:08d}"


class ResultsStore:
    """A results root (local directory or `s3://bucket/prefix`)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, root_path = resolve(root, storage_options)
        if is_local(self.fs):
            root_path = os.path.abspath(os.path.expanduser(root_path))
        self.root_path = root_path.rstrip("/") or root_path
        self.local = is_local(self.fs)

    def _dir(self, run: str, step: int) -> str:
        run_part, step_part = step_parts(run, step)
        return join(self.fs, join(self.fs, self.root_path, run_part), step_part)

    def url(self, run: str, step: int, name: str) -> str:
        """The user-facing location of file `name` of (run, step): a path, or `s3://...`."""
        return to_url(self.fs, join(self.fs, self._dir(run, step), name))

    def link(self, run: str, step: int, name: str) -> str:
        """`url` as a link for a Prefect artifact (`file://` for a local path)."""
        url = self.url(run, step, name)
        return Path(url).as_uri() if self.local else url

    def exists(self, run: str, step: int, name: str) -> bool:
        return bool(self.fs.exists(join(self.fs, self._dir(run, step), name)))

    def write(self, run: str, step: int, name: str, table: pa.Table) -> str:
        """Write `table` as Parquet file `name` of (run, step); returns its url."""
        buf = io.BytesIO()
        pq.write_table(table, buf)
        directory = self._dir(run, step)
        path = join(self.fs, directory, name)
        if self.local:
            _write_private(directory, self.root_path, name, buf.getvalue())
        else:
            with self.fs.open(path, "wb") as f:
                f.write(buf.getvalue())
        return to_url(self.fs, path)

    def read(self, run: str, step: int, name: str) -> pa.Table:
        """File `name` of (run, step); `FileNotFoundError` naming it when absent."""
        path = join(self.fs, self._dir(run, step), name)
        if not self.fs.exists(path):
            raise FileNotFoundError(f"no {name} for {run} step {step} under {to_url(self.fs, self.root_path)}")
        with self.fs.open(path, "rb") as f:
            return pq.read_table(f)


def _write_private(directory: str, root: str, name: str, data: bytes) -> None:
    """Create `directory` (and the root) 0700 and write `name` 0600 through a renamed temp file."""
    os.makedirs(root, 0o700, exist_ok=True)
    for d in (root, os.path.dirname(directory), directory):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
        if os.path.islink(d):
            raise ResultsPathError(f"{d!r} is a symlink; results are written only below real directories")
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        replace_durably(tmp, os.path.join(directory, name))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
