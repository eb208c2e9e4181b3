"""Folding the worker's metric events into `totals.json` (`pinned_eval.prometheus_totals`): exact
counts across scrapes, restarts, two collectors and a crash at every step of a fold, and a
directory that keeps only the events since the last scrape."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pinned_eval import prometheus as prom
from pinned_eval import prometheus_totals as totals_mod
from pinned_eval import writer_temps

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "metrics"
    monkeypatch.setenv(prom.METRICS_DIR_ENV, str(path))
    prom.private_metrics_dir(path)
    return path


def counts(root: Path) -> dict[str, float]:
    """One scrape of a fresh collector (a restarted worker): points per run/outcome/reason,
    observation counts, unreadable events."""
    out: dict[str, float] = {}
    for family in prom.PointMetricsCollector(root).collect():
        for s in family.samples:
            if s.name in ("pinned_eval_points_total", "pinned_eval_metrics_unreadable_events_total") \
                    or s.name.endswith("_count") or s.name.endswith("_sum"):
                out[s.name + "/" + "/".join(v for k, v in sorted(s.labels.items()))] = s.value
    return out


def record(n: int, run: str = "exp") -> None:
    for i in range(n):
        prom.point_ended(run, "measured" if i % 2 else "skipped", "" if i % 2 else "busy", 1.0)
    prom.pin_timed("fleet", 2.0)


def test_counts_stay_exact_over_scrapes_restarts_and_two_collectors(root: Path) -> None:
    first, second = prom.PointMetricsCollector(root), prom.PointMetricsCollector(root)  # two workers, one directory
    record(5)
    list(first.collect())
    assert os.listdir(root / "events") == []
    record(3)
    list(second.collect())  # folds on top of what the first one folded, read back from totals.json
    record(4, run="other")
    list(first.collect())
    assert counts(root) == {
        "pinned_eval_points_total/skipped/busy/exp": 5.0, "pinned_eval_points_total/measured//exp": 3.0,
        "pinned_eval_points_total/skipped/busy/other": 2.0, "pinned_eval_points_total/measured//other": 2.0,
        "pinned_eval_point_duration_seconds_count/skipped/exp": 5.0,
        "pinned_eval_point_duration_seconds_sum/skipped/exp": 5.0,
        "pinned_eval_point_duration_seconds_count/measured/exp": 3.0,
        "pinned_eval_point_duration_seconds_sum/measured/exp": 3.0,
        "pinned_eval_point_duration_seconds_count/skipped/other": 2.0,
        "pinned_eval_point_duration_seconds_sum/skipped/other": 2.0,
        "pinned_eval_point_duration_seconds_count/measured/other": 2.0,
        "pinned_eval_point_duration_seconds_sum/measured/other": 2.0,
        "pinned_eval_pin_duration_seconds_count/fleet": 3.0, "pinned_eval_pin_duration_seconds_sum/fleet": 6.0,
        "pinned_eval_metrics_unreadable_events_total/": 0.0,
    }
    assert counts(root) == counts(root), "a scrape with no new event changes nothing"
    assert sorted(os.listdir(root)) == ["events", "inflight", "totals.json", "totals.lock"]


CRASH = textwrap.dedent("""
    import os, sys
    from pinned_eval import prometheus as prom, prometheus_totals as t
    where = sys.argv[1]
    if where == "before_rename":  # the temp totals written, the process dies before renaming it
        real_fsync = os.fsync
        def fsync(fd):
            real_fsync(fd)
            os._exit(9)
        t.os.fsync = fsync
    else:  # totals renamed, the process dies after removing one folded event file
        real_save, real_remove, saved = t._save, t._remove, []
        def save(*args):
            real_save(*args)
            saved.append(1)
        def remove(path):
            real_remove(path)
            if saved:
                os._exit(9)
        t._save, t._remove = save, remove
    list(prom.PointMetricsCollector(sys.argv[2]).collect())
""")


@pytest.mark.parametrize("where", ["before_rename", "mid_removal"])
def test_a_crash_at_any_step_of_a_fold_never_loses_or_double_counts(root: Path, where: str) -> None:
    record(4)
    list(prom.PointMetricsCollector(root).collect())  # a totals file already holds 4 points + 1 pin
    record(6)  # 7 new event files
    done = subprocess.run([sys.executable, "-c", CRASH, where, str(root)], timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 9, "the fold was killed where injected"
    left = len(os.listdir(root / "events"))
    assert left == (7 if where == "before_rename" else 6)
    assert counts(root) == {
        "pinned_eval_points_total/skipped/busy/exp": 5.0, "pinned_eval_points_total/measured//exp": 5.0,
        "pinned_eval_point_duration_seconds_count/skipped/exp": 5.0,
        "pinned_eval_point_duration_seconds_sum/skipped/exp": 5.0,
        "pinned_eval_point_duration_seconds_count/measured/exp": 5.0,
        "pinned_eval_point_duration_seconds_sum/measured/exp": 5.0,
        "pinned_eval_pin_duration_seconds_count/fleet": 2.0, "pinned_eval_pin_duration_seconds_sum/fleet": 4.0,
        "pinned_eval_metrics_unreadable_events_total/": 0.0,
    }
    assert os.listdir(root / "events") == []
    assert sorted(os.listdir(root)) == ["events", "inflight", "totals.json", "totals.lock"], "temp file gone"


def test_an_event_that_cannot_be_removed_is_never_counted_twice(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record(2)
    stuck = sorted(os.listdir(root / "events"))[0]
    real = totals_mod._remove
    monkeypatch.setattr(totals_mod, "_remove", lambda p: False if p.name == stuck else real(p))
    list(prom.PointMetricsCollector(root).collect())
    assert os.listdir(root / "events") == [stuck]
    record(1)
    list(prom.PointMetricsCollector(root).collect())  # still stuck: named in `folded` again, not re-read
    monkeypatch.setattr(totals_mod, "_remove", real)
    after = counts(root)
    assert os.listdir(root / "events") == []
    assert (after["pinned_eval_points_total/skipped/busy/exp"], after["pinned_eval_points_total/measured//exp"],
            after["pinned_eval_pin_duration_seconds_count/fleet"]) == (2.0, 1.0, 2.0)


def test_an_unreadable_event_is_counted_once_and_removed(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    (root / "events" / "1-1-1.json").write_text("{not json")
    record(1)
    with caplog.at_level(logging.WARNING, logger="pinned_eval.prometheus"):
        first = counts(root)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("prometheus metrics: event 1-1-1.json unreadable: ")
    assert first["pinned_eval_metrics_unreadable_events_total/"] == 1.0
    assert counts(root) == first and os.listdir(root / "events") == []


def test_a_corrupt_totals_file_loses_no_event(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    record(1)
    list(prom.PointMetricsCollector(root).collect())
    (root / "totals.json").write_text("{\"version\": 1, \"points\": [[\"exp\"]]}")
    record(2)
    with caplog.at_level(logging.ERROR, logger="pinned_eval.prometheus"):
        families = [f.name for f in prom.PointMetricsCollector(root).collect()]
    assert families == ["pinned_eval_points_in_flight"], "no point metrics rather than wrong ones"
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"prometheus metrics: scrape without point metrics: metrics totals "
                           f"{str(root / 'totals.json')!r} unreadable (")
    assert line.endswith("move it aside to restart the counts from the events still in events/")
    assert len(os.listdir(root / "events")) == 3, "nothing folded, nothing removed"
    os.rename(root / "totals.json", root / "totals.json.bad")
    after = counts(root)
    assert (after["pinned_eval_points_total/skipped/busy/exp"], after["pinned_eval_points_total/measured//exp"],
            after["pinned_eval_pin_duration_seconds_count/fleet"]) == (1.0, 1.0, 1.0)


def test_a_totals_file_that_is_a_symlink_is_never_followed(root: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"version": 1, "points": [["exp", "measured", "", 1000]]}')
    os.symlink(elsewhere, root / "totals.json")
    record(1)
    with caplog.at_level(logging.ERROR, logger="pinned_eval.prometheus"):
        families = [f.name for f in prom.PointMetricsCollector(root).collect()]
    assert families == ["pinned_eval_points_in_flight"]
    [line] = [r.getMessage() for r in caplog.records]
    assert "unreadable: [Errno 40] Too many levels of symbolic links" in line
    assert len(os.listdir(root / "events")) == 2 and elsewhere.read_text().endswith("1000]]}")


# A flow-run process that writes its event (or in-flight) temp file, says its name and waits: on
# `go` it renames it; killed meanwhile, it leaves the temp file behind.
WRITER = textwrap.dedent("""
    import os, sys
    from pinned_eval import prometheus as prom
    real_rename = os.rename
    def rename(src, dst):
        print(os.path.basename(src), flush=True)
        if sys.stdin.readline() == "go\\n":
            real_rename(src, dst)
    prom.os.rename = rename
    if sys.argv[1] == "event":
        prom.point_ended("exp", "measured", "", 3.0)
    else:
        prom.InFlight("exp").start()
    print("done", flush=True)
""")
ONE_SKIP = {
    "pinned_eval_points_total/skipped/busy/exp": 1.0,
    "pinned_eval_point_duration_seconds_count/skipped/exp": 1.0,
    "pinned_eval_point_duration_seconds_sum/skipped/exp": 1.0,
    "pinned_eval_pin_duration_seconds_count/fleet": 1.0, "pinned_eval_pin_duration_seconds_sum/fleet": 2.0,
    "pinned_eval_metrics_unreadable_events_total/": 0.0,
}


def start_writer(what: str) -> tuple[subprocess.Popen[str], str]:
    """A writer stopped between writing its temp file and renaming it, and that file's name."""
    child = subprocess.Popen([sys.executable, "-c", WRITER, what], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert child.stdout is not None
    return child, child.stdout.readline().strip()


def test_a_live_writers_temp_file_survives_a_scrape_uncounted(root: Path) -> None:
    record(1)
    child, tmp = start_writer("event")
    try:
        assert re.fullmatch(rf"\.tmp-p{child.pid}s[0-9]+-[0-9]{{20}}-{child.pid}-0\.json", tmp), tmp
        assert counts(root) == ONE_SKIP, "the temp file is not counted"
        assert os.listdir(root / "events") == [tmp], "nor removed: its writer lives"
        assert prom.PointMetricsCollector(root).in_flight() == {}
        assert child.communicate("go\n", timeout=120) == ("done\n", None)  # the writer renames it
    finally:
        child.kill()
        child.wait()
    assert counts(root) == {**ONE_SKIP, "pinned_eval_points_total/measured//exp": 1.0,
                            "pinned_eval_point_duration_seconds_count/measured/exp": 1.0,
                            "pinned_eval_point_duration_seconds_sum/measured/exp": 3.0}
    assert os.listdir(root / "events") == []


@pytest.mark.parametrize("what", ["event", "inflight"])
def test_the_temp_file_of_a_writer_killed_before_its_rename_is_removed_uncounted(
    root: Path, what: str, caplog: pytest.LogCaptureFixture
) -> None:
    record(1)
    child, tmp = start_writer(what)
    assert tmp.startswith(f".tmp-p{child.pid}s"), tmp
    assert tmp in os.listdir(root / ("events" if what == "event" else "inflight"))
    child.kill()  # SIGKILL: no rename, no cleanup
    assert child.wait(timeout=120) == -signal.SIGKILL
    with caplog.at_level(logging.WARNING, logger="pinned_eval.prometheus"):
        assert counts(root) == ONE_SKIP
    assert [r.getMessage() for r in caplog.records] == [
        f"prometheus metrics: removed {tmp}: its writer died before renaming it (not counted)"]
    assert os.listdir(root / "events") == [] and os.listdir(root / "inflight") == []


def test_a_temp_file_is_removed_only_when_its_writer_is_provably_gone(root: Path) -> None:
    """A live PID with another start time is a reused PID: its writer is gone. Names that are not
    ours to judge stay."""
    me = os.getpid()
    dead = subprocess.Popen(["true"])
    dead.wait()
    own = writer_temps.temp_name("1-1-1.json")
    start = int(own.split("-")[1].partition("s")[2])
    assert own == f".tmp-p{me}s{start}-1-1-1.json" and start > 0
    names = {own: True, f".tmp-p{me}s{start + 1}-a.json": False, f".tmp-p{me}s0-b.json": True,
             f".tmp-p{dead.pid}s{start}-c.json": False, f".tmp-p{dead.pid}s0-d.json": False,
             ".tmp-p0s1-e.json": True, ".tmp-1-2-3.json": True, ".tmp-abc": True}
    for name in names:
        (root / "events" / name).write_text("{not json")
    assert counts(root)["pinned_eval_metrics_unreadable_events_total/"] == 0.0, "no temp file is read"
    assert sorted(os.listdir(root / "events")) == sorted(n for n, kept in names.items() if kept)


def test_a_start_time_is_read_past_a_process_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    import psutil

    odd = tmp_path / "w) 7 8 (x"  # the process name `comm` that /proc/<pid>/stat shows in parentheses
    shutil.copy("/bin/sleep", odd)
    child = subprocess.Popen([str(odd), "600"])
    try:
        ticks = writer_temps._start_ticks(child.pid)
        assert ticks is not None and psutil.Process(child.pid).name() == odd.name
        assert abs(psutil.boot_time() + ticks / os.sysconf("SC_CLK_TCK")
                   - psutil.Process(child.pid).create_time()) < 0.05
        assert not writer_temps._writer_gone(child.pid, ticks) and writer_temps._writer_gone(child.pid, ticks + 1)
    finally:
        child.kill()
        child.wait()
    assert writer_temps._start_ticks(child.pid) is None
