"""Where a run's results live: `<root>/<run>/step_<step:08d>/{generations,samples}.parquet`.

Invariants:
- paths are built from the run name through the staging layout's mapping (`run_key`, the same
  `<run_key>/step_<step:08d>` directories as `Staging.path_for`), never by joining raw strings: a
  refused run name (a `/`, `..`, a newline) raises `ResultsPathError` before anything is opened,
  and two runs never share a directory, even on a case-folding filesystem (`Exp42` vs `exp42`);
- local files are written 0600 in directories 0700 (created with that mode, whatever the umask),
  through a temporary file renamed into place, so a reader sees a whole file or the previous one;
- every local write and read checks the whole path first (`pinned_eval.trusted_paths`): the root,
  the run and step directories and each directory above them must be this user's (or root's) and
  not writable by group or others unless sticky, so a neighbour who created `results_root` or a
  run/step directory under it before this user is refused (`UntrustedPathError`), never written
  into or read from; a file read must be a regular file of this user, not a symlink or a FIFO;
- every file carries the point it was written for (schema metadata `pinned_eval.point`: run and
  step); `read` refuses a file written for another point, or carrying none, with `ResultsKeyError`
  (a score is never computed from generations that are not this point's);
- an S3 root is written and read with the staging block's endpoint and credentials
  (`StagingBlock.s3_options()`); S3 uploads are whole objects, so readers never see a partial one.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pinned_eval.durable import replace_durably
from pinned_eval.points import run_key
from pinned_eval.snapshot.layout import is_local, join, resolve, to_url
from pinned_eval.trusted_paths import make_private_dirs, open_trusted_file

GENERATIONS = "generations.parquet"
SAMPLES = "samples.parquet"
POINT_META = b"pinned_eval.point"


class ResultsPathError(ValueError):
    """A run name or step that cannot name a results directory."""


class ResultsKeyError(ValueError):
    """A stored file that was not written for the point it is read for."""


def _point_key(run: str, step: int) -> bytes:
    return json.dumps({"run": run, "step": step}, sort_keys=True).encode()


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
        meta = {**(table.schema.metadata or {}), POINT_META: _point_key(run, step)}
        buf = io.BytesIO()
        pq.write_table(table.replace_schema_metadata(meta), buf)
        directory = self._dir(run, step)
        path = join(self.fs, directory, name)
        if self.local:
            _write_private(directory, self.root_path, name, buf.getvalue())
        else:
            with self.fs.open(path, "wb") as f:
                f.write(buf.getvalue())
        return to_url(self.fs, path)

    def read(self, run: str, step: int, name: str) -> pa.Table:
        """File `name` of (run, step); `FileNotFoundError` naming it when absent, `ResultsKeyError`
        when it was written for another point (or carries no point), `UntrustedPathError` when a
        directory on the way or the file is not this user's alone."""
        path = join(self.fs, self._dir(run, step), name)
        if not self.fs.exists(path):
            raise FileNotFoundError(f"no {name} for {run} step {step} under {to_url(self.fs, self.root_path)}")
        if self.local:
            with os.fdopen(open_trusted_file(path, "results file"), "rb") as f:
                table = pq.read_table(f)
        else:
            with self.fs.open(path, "rb") as f:
                table = pq.read_table(f)
        written_for = (table.schema.metadata or {}).get(POINT_META)
        if written_for != _point_key(run, step):
            said = "no point" if written_for is None else written_for.decode(errors="replace")[:200]
            raise ResultsKeyError(f"{to_url(self.fs, path)} was not written for {run} step {step} (it names "
                                  f"{said}); refusing to read it: rerun the point to write it again")
        return table


def _write_private(directory: str, root: str, name: str, data: bytes) -> None:
    """Create `directory` (and the root) 0700 below trusted directories only, and write `name` 0600
    through a renamed temp file."""
    make_private_dirs(root, "results_root")
    for d in (os.path.dirname(directory), directory):
        if os.path.islink(d):
            raise ResultsPathError(f"{d!r} is a symlink; results are written only below real directories")
    make_private_dirs(directory, "results_root")
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
