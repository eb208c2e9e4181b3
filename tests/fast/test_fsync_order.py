"""Every atomic write of the product: the data is fsync'd before the rename, the directory after.

Recorded, not timed: `os.fsync` and `os.replace` are wrapped by a recorder that logs what each
call acted on (an fsync'd descriptor by the path it has open, read from /proc/self/fd) and then
does the real call, so each test asserts the exact sequence one write made. The helpers:
`trainer_integration.spool.Spool.append`, `pinned_eval.sinks.JsonlSink.compact` (its appends fsync
the file, and the directory of a new one),
`pinned_eval.results.store.ResultsStore.write`, `pinned_eval.fleet.keys.write_private`,
`pinned_eval.snapshot.staging.Staging.materialize` (the download cache), all but the spool
through `pinned_eval.durable.replace_durably`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pinned_eval.durable import replace_durably
from pinned_eval.fleet.keys import write_private
from pinned_eval.results.store import ResultsStore
from pinned_eval.sinks import JsonlSink, MetricRow
from pinned_eval.snapshot.layout import MARKER
from pinned_eval.snapshot.staging import Staging
from pinned_eval.snapshot.writer import write_snapshot
from tests.s3_fixtures import S3Server, s3_server  # noqa: F401 - fixture
from tests.snapshot_fixtures import named_tensors
from trainer_integration.spool import Spool, SpoolEntry

Event = tuple[str, ...]


class Recorder:
    """Logs ("fsync", path) and ("replace", src, dst) for every call, in order, then does it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[Event] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def replace(src: Any, dst: Any, **kw: Any) -> None:
            self.events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
            real_replace(src, dst, **kw)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def under(self, directory: Path) -> list[Event]:
        """The events that touched `directory` or anything in it."""
        d = os.path.realpath(directory)
        return [e for e in self.events if any(p == d or p.startswith(d + os.sep) for p in e[1:])]


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    return Recorder(monkeypatch)


def _one_rename(events: list[Event], dest: Path) -> str:
    """Assert `events` are exactly: fsync tmp, rename tmp -> dest, fsync dest's directory; the tmp."""
    dest_real = os.path.realpath(dest)
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"], events
    (_, synced), (_, src, dst), (_, dir_synced) = events
    assert synced == src != dst == dest_real
    assert os.path.dirname(src) == os.path.dirname(dest_real)  # same directory: an atomic rename
    assert dir_synced == os.path.dirname(dest_real)
    return src


def test_the_spool_fsyncs_each_entry_before_its_rename_and_the_directory_after(tmp_path: Path, rec: Recorder) -> None:
    spool = Spool(tmp_path / "s")
    real = Path(os.path.realpath(spool.dir))
    spool.append(SpoolEntry(kind="event", run="exp1", step=3, key="k3", body={}))
    # the counter is renamed first (no fsync of its own: the directory fsync after the entry's
    # rename makes both names durable, and a lost counter is rebuilt from the entries)
    assert rec.events[0] == ("replace", str(real / ".seq.tmp"), str(real / ".seq"))
    tmp = _one_rename(rec.events[1:], real / "000000000001.json")
    assert Path(tmp).name.startswith(".tmp-") and not Path(tmp).exists()


def test_the_ledger_fsyncs_each_append_a_new_files_directory_and_compacts_through_one_rename(
    tmp_path: Path, rec: Recorder
) -> None:
    sink = JsonlSink(tmp_path / "sinks" / "metrics.jsonl")
    real = os.path.realpath(sink.path)
    sink.write_point([MetricRow(run="exp1", step=1, dataset="d", state="measured", metrics={"eval/x": 1.0})])
    assert rec.under(tmp_path) == [("fsync", real), ("fsync", os.path.dirname(real))]  # a new name: its directory
    sink.write_point([MetricRow(run="exp1", step=2, dataset="d", state="measured", metrics={"eval/x": 2.0})])
    sink.write_point([MetricRow(run="exp1", step=1, dataset="d", state="measured", metrics={"eval/x": 3.0})])
    assert rec.under(tmp_path)[2:] == [("fsync", real), ("fsync", real)]  # appends: the file's data only
    del rec.events[:]
    assert sink.compact()
    _one_rename(rec.under(tmp_path), sink.path)
    assert [(r.step, r.metrics) for r in sink.read()] == [(2, {"eval/x": 2.0}), (1, {"eval/x": 3.0})]


def test_the_results_store_fsyncs_each_file_before_its_rename_and_the_directory_after(
    tmp_path: Path, rec: Recorder
) -> None:
    store = ResultsStore(str(tmp_path / "results"))
    written = store.write("exp1", 5, "samples.parquet", pa.table({"x": [1, 2]}))
    _one_rename(rec.under(tmp_path), Path(written))
    assert store.read("exp1", 5, "samples.parquet").to_pydict() == {"x": [1, 2]}


def test_the_fleet_key_file_is_fsynced_before_its_rename_and_the_directory_after(tmp_path: Path, rec: Recorder) -> None:
    path = tmp_path / "keys" / "sglang.yaml"
    write_private(path, "api-key: x\n")
    _one_rename(rec.under(tmp_path), path)
    assert path.read_text() == "api-key: x\n" and path.stat().st_mode & 0o777 == 0o600


def test_the_staging_cache_fsyncs_every_downloaded_file_and_its_directory_before_the_rename(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811 - fixture
) -> None:
    staging = Staging(f"s3://{s3_server.make_bucket()}/stage", storage_options=s3_server.storage_options,
                      cache_dir=tmp_path / "cache")
    url = staging.path_for("exp1", 4)
    write_snapshot(named_tensors(seed=4), url, storage_options=staging.storage_options, metadata={"run": "exp1"})
    rec = Recorder(monkeypatch)
    entry = staging.materialize(url)
    events = rec.under(tmp_path / "cache")
    names = sorted(p.name for p in entry.iterdir())
    assert MARKER in names and any(n.endswith(".safetensors") for n in names)
    tmp = events[len(names)][1]  # after one fsync per file: the download directory itself
    assert events == [
        *(("fsync", os.path.join(tmp, n)) for n in names),
        ("fsync", tmp),
        ("replace", tmp, os.path.realpath(entry)),
        ("fsync", os.path.realpath(staging.cache_dir)),
    ]


def test_replace_durably_fsyncs_a_directorys_files_itself_then_renames_then_the_parent(
    tmp_path: Path, rec: Recorder
) -> None:
    src = tmp_path / "tmp"
    (src / "sub").mkdir(parents=True)
    for name in ("b", "a"):
        (src / name).write_text(name)
    (src / "link").symlink_to(src / "a")
    replace_durably(src, tmp_path / "dest")
    real = os.path.realpath(tmp_path)
    assert rec.events == [
        ("fsync", f"{real}/tmp/a"), ("fsync", f"{real}/tmp/b"), ("fsync", f"{real}/tmp"),
        ("replace", f"{real}/tmp", f"{real}/dest"), ("fsync", real),
    ]
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == ["a", "b", "link", "sub"]
