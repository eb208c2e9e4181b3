"""The Prometheus metrics (docs/metrics.md): the worker's event directory and collector
(`pinned_eval.prometheus`), read over real HTTP with prometheus_client's parser, and the trainer's
spool-depth gauge (`trainer_integration.prometheus`)."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pinned_eval import prometheus as prom
from pinned_eval.trusted_paths import UntrustedPathError
from trainer_integration.prometheus import register_spool_depth
from trainer_integration.spool import Spool, SpoolEntry

REPO = Path(__file__).resolve().parents[2]
Samples = dict[str, list[tuple[str, dict[str, str], float]]]


def scrape(url: str) -> Samples:
    text = httpx.get(url, timeout=10).text
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


@pytest.fixture
def metrics_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "metrics"
    monkeypatch.setenv(prom.METRICS_DIR_ENV, str(root))
    return root


@pytest.fixture
def endpoint(metrics_dir: Path) -> Iterator[str]:
    server, url = prom.serve_metrics(metrics_dir, 0)
    assert url.startswith("http://127.0.0.1:"), "bound to loopback by default"
    try:
        yield url
    finally:
        server.shutdown()


def test_outcomes_and_pins_are_counted_exactly_with_their_histograms(endpoint: str, metrics_dir: Path) -> None:
    prom.point_ended("exp", "measured", "", 45.0)
    prom.point_ended("exp", "measured", "", 700.0)
    prom.point_ended("exp", "skipped", "busy", None)  # no duration known: counted, not observed
    prom.point_ended("other", "failed", "crashed", 5.0)
    prom.pin_timed("fleet-a", 1.5)

    m = scrape(endpoint)
    assert m["pinned_eval_points"] == [
        ("pinned_eval_points_total", {"run": "exp", "outcome": "measured", "reason": ""}, 2.0),
        ("pinned_eval_points_total", {"run": "exp", "outcome": "skipped", "reason": "busy"}, 1.0),
        ("pinned_eval_points_total", {"run": "other", "outcome": "failed", "reason": "crashed"}, 1.0),
    ]
    measured = {s[1].get("le"): s[2] for s in m["pinned_eval_point_duration_seconds"]
                if s[1]["run"] == "exp" and s[1]["outcome"] == "measured"}
    assert measured == {"10.0": 0, "30.0": 0, "60.0": 1, "120.0": 1, "300.0": 1, "600.0": 1, "1200.0": 2,
                        "1800.0": 2, "3600.0": 2, "7200.0": 2, "+Inf": 2, None: 745.0}
    counts = {(s[1]["run"], s[1]["outcome"]): s[2] for s in m["pinned_eval_point_duration_seconds"]
              if s[0].endswith("_count")}
    assert counts == {("exp", "measured"): 2.0, ("other", "failed"): 1.0}
    pins = {s[0]: s[2] for s in m["pinned_eval_pin_duration_seconds"] if s[1].get("le") in (None, "2.0")}
    assert pins == {"pinned_eval_pin_duration_seconds_bucket": 1.0, "pinned_eval_pin_duration_seconds_count": 1.0,
                    "pinned_eval_pin_duration_seconds_sum": 1.5}
    prom.point_ended("exp", "measured", "", 1.0)
    again = scrape(endpoint)["pinned_eval_points"]
    assert again[0][2] == 3.0 and again[1:] == m["pinned_eval_points"][1:], "new events only, none twice"
    assert os.listdir(metrics_dir / "events") == [], "every event folded into the totals and removed"
    assert sorted(os.listdir(metrics_dir)) == ["events", "inflight", "totals.json", "totals.lock"], "no temp file"
    assert stat.S_IMODE(os.stat(metrics_dir / "totals.json").st_mode) == 0o600
    restarted = {f.name: [(s.name, s.labels, s.value) for s in f.samples]  # a new worker, the same directory
                 for f in prom.PointMetricsCollector(metrics_dir).collect()}
    assert restarted["pinned_eval_points"] == scrape(endpoint)["pinned_eval_points"]


def test_a_point_in_flight_counts_until_it_ends_or_its_process_dies(endpoint: str, metrics_dir: Path) -> None:
    here = prom.InFlight("exp").start()
    child = subprocess.Popen(  # a flow-run process SIGKILLed mid-point: no `end()`
        [sys.executable, "-c", "from pinned_eval.prometheus import InFlight; import sys, time; "
         "InFlight('exp').start(); print('up', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        assert scrape(endpoint)["pinned_eval_points_in_flight"] == [
            ("pinned_eval_points_in_flight", {"run": "exp"}, 2.0)]
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert scrape(endpoint)["pinned_eval_points_in_flight"] == [
            ("pinned_eval_points_in_flight", {"run": "exp"}, 1.0)]
        assert len(os.listdir(metrics_dir / "inflight")) == 1, "the dead process's file is removed"
        here.end()
        assert scrape(endpoint)["pinned_eval_points_in_flight"] == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_without_the_env_nothing_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prom.METRICS_DIR_ENV, raising=False)
    prom.point_ended("exp", "measured", "", 1.0)
    prom.InFlight("exp").start().end()
    assert list(tmp_path.iterdir()) == []


def test_a_directory_a_neighbour_can_write_is_refused_and_a_point_never_raises(
    metrics_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prom.private_metrics_dir(metrics_dir)
    os.chmod(metrics_dir / "events", 0o770)  # its group could plant events
    with caplog.at_level(logging.WARNING, logger="pinned_eval.prometheus"):
        prom.point_ended("exp", "measured", "", 1.0)
    assert os.listdir(metrics_dir / "events") == []
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("prometheus metrics: point event not recorded: metrics directory ")
    assert "writable by its group" in warning
    with pytest.raises(UntrustedPathError, match="writable by its group"):
        prom.PointMetricsCollector(metrics_dir)
    os.chmod(metrics_dir / "events", 0o750)  # readable by its group: not private, refused too
    with pytest.raises(UntrustedPathError, match="mode 750, not 0700"):
        prom.private_metrics_dir(metrics_dir)


def test_a_path_that_is_a_file_is_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(prom.METRICS_DIR_ENV, str(tmp_path / "file"))
    with caplog.at_level(logging.WARNING, logger="pinned_eval.prometheus"):
        prom.pin_timed("f", 1.0)
        flight = prom.InFlight("exp").start()
        flight.end()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["prometheus metrics"] * 2


def test_the_spool_depth_gauge_counts_undelivered_entries(tmp_path: Path) -> None:
    class Client:
        run = "exp"
        spool = Spool(tmp_path / "spool")

    registry = CollectorRegistry()
    url = register_spool_depth(Client(), registry=registry, port=0)
    assert url is not None and url.startswith("http://127.0.0.1:")
    assert scrape(url)["pinned_eval_spool_depth"] == [("pinned_eval_spool_depth", {"run": "exp"}, 0.0)]
    entries = [Client.spool.append(SpoolEntry(kind="event", run="exp", step=s, key=f"k{s}", body={})) for s in (1, 2)]
    assert scrape(url)["pinned_eval_spool_depth"] == [("pinned_eval_spool_depth", {"run": "exp"}, 2.0)]
    Client.spool.remove(entries[0])
    assert scrape(url)["pinned_eval_spool_depth"] == [("pinned_eval_spool_depth", {"run": "exp"}, 1.0)]


def test_trainer_integration_needs_neither_prometheus_client_nor_prefect() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["prometheus_client"] = None  # not installed
        import trainer_integration, trainer_integration.prometheus as p
        assert "prefect" not in sys.modules and sys.modules["prometheus_client"] is None
        class C:
            run, spool = "exp", None
        try:
            p.register_spool_depth(C())
        except ImportError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "register_spool_depth: needs prometheus_client: pip install 'pinned-eval[prometheus]'\n"


def test_a_scrape_before_any_point_has_no_series(endpoint: str) -> None:
    m = scrape(endpoint)
    assert m["pinned_eval_points"] == [] and m["pinned_eval_points_in_flight"] == []
    assert m["pinned_eval_metrics_unreadable_events"] == [("pinned_eval_metrics_unreadable_events_total", {}, 0.0)]


def test_the_worker_refuses_to_serve_from_a_directory_others_can_write(tmp_path: Path) -> None:
    from app.commands._cli import CliError
    from app.commands.stack import _serve_metrics

    root = tmp_path / "metrics"
    prom.private_metrics_dir(root)
    os.chmod(root, 0o777)
    with pytest.raises(CliError) as info:
        _serve_metrics(root, 0, "127.0.0.1")
    assert str(info.value).startswith(f"--metrics-port: metrics directory {str(root)!r} refused: it is writable by "
                                      "others without the sticky bit")
    with pytest.raises(CliError, match=r"^--metrics-port: 70000 is not a port \(0-65535\)$"):
        _serve_metrics(root, 70000, "127.0.0.1")


def test_the_worker_endpoint_counts_tracker_exports_waiting_in_its_outbox(metrics_dir: Path, tmp_path: Path) -> None:
    from pinned_eval.sinks.exporters import Parcel
    from pinned_eval.sinks.outbox import Envelope, Outbox

    server, url = prom.serve_metrics(metrics_dir, 0, outbox=tmp_path / "outbox")
    try:
        assert scrape(url)["pinned_eval_tracker_exports_waiting"] == [
            ("pinned_eval_tracker_exports_waiting", {}, 0.0)]  # no outbox yet: none waiting
        outbox = Outbox(tmp_path / "outbox")
        parcel = Parcel(exporter="wandb", config={}, body={})
        posted = [outbox.post(Envelope(run="exp", step=s, parcels=[parcel])) for s in (1, 2, 3)]
        (outbox.root / ".tmp-00000000000000000009-1-0.json").write_text("{}")  # a post in progress
        assert scrape(url)["pinned_eval_tracker_exports_waiting"] == [("pinned_eval_tracker_exports_waiting", {}, 3.0)]
        outbox.remove(posted[0])
        assert scrape(url)["pinned_eval_tracker_exports_waiting"] == [("pinned_eval_tracker_exports_waiting", {}, 2.0)]
    finally:
        server.shutdown()
