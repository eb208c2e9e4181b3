"""The outbox and its deliverer: W&B and MLflow exports leave the point's path when a deliverer
serves the worker's outbox, and reach the tracker (real W&B offline files, a real HTTP refusal
from MLflow's client) or the point's ledger rows as an error (pinned_eval.sinks.outbox, .delivery).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pinned_eval.polling import poll_until
from pinned_eval.sinks import Ledger, MetricRow, PointRecord
from pinned_eval.sinks.delivery import Deliverer
from pinned_eval.sinks.mlflow import MlflowConfig, MlflowExporter
from pinned_eval.sinks.outbox import LOCK_FILE, OUTBOX_ENV, REJECTED, Envelope, Outbox, defer
from pinned_eval.sinks.tensorboard import TensorboardExporter
from pinned_eval.sinks.wandb import WandbConfig, WandbExporter
from pinned_eval.trusted_paths import UntrustedPathError
from tests.conftest import free_port
from tests.wandb_offline import history_rows

REPO = Path(__file__).resolve().parents[2]


def _rows(run: str, step: int, flow_run_id: str, value: float) -> list[MetricRow]:
    return [MetricRow(run=run, step=step, dataset="gsm8k", state="measured", weight_version=str(step),
                      metrics={"eval/step": float(step), "eval/gsm8k": value}, flow_run_id=flow_run_id)]


def _record(run: str, step: int, value: float, flow_run_id: str = "fr-1") -> PointRecord:
    return PointRecord(run, step, _rows(run, step, flow_run_id, value), flow_run_id)


def _wandb(tmp_path: Path) -> WandbExporter:
    return WandbExporter(WandbConfig(project="p", mode="offline", directory=str(tmp_path / "wb")), None)


def _dead_mlflow() -> MlflowExporter:
    return MlflowExporter(MlflowConfig(tracking_uri=f"http://127.0.0.1:{free_port()}", token="s3cret"))


class Served:
    """A deliverer thread serving `outbox` until `stop()`."""

    def __init__(self, outbox: Outbox, **kwargs: float) -> None:
        self.deliverer = Deliverer(outbox, poll_s=0.05, **kwargs)
        self.event = threading.Event()
        self.thread = threading.Thread(target=self.deliverer.run, args=(self.event,), daemon=True)
        self.thread.start()
        poll_until(outbox.served, timeout_s=10, interval_s=0.02, what="the deliverer to hold the outbox")

    def stop(self) -> None:
        self.event.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


@pytest.fixture
def outbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Outbox:
    root = tmp_path / "outbox"
    monkeypatch.setenv(OUTBOX_ENV, str(root))
    return Outbox(root)


@pytest.fixture
def served(outbox: Outbox) -> Iterator[Served]:
    s = Served(outbox)
    yield s
    s.stop()


def test_without_a_served_outbox_every_exporter_runs_on_the_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporters = [_wandb(tmp_path), TensorboardExporter(str(tmp_path / "tb"), None)]
    monkeypatch.delenv(OUTBOX_ENV, raising=False)
    assert defer(exporters, _record("exp", 1, 0.5), None) == (exporters, [], {})
    monkeypatch.setenv(OUTBOX_ENV, str(tmp_path / "outbox"))  # an outbox nobody serves: nobody would send
    assert defer(exporters, _record("exp", 1, 0.5), None) == (exporters, [], {})
    assert Outbox(tmp_path / "outbox").pending() == []


def test_a_served_outbox_takes_wandb_and_mlflow_and_the_deliverer_sends_them(
    tmp_path: Path, outbox: Outbox, served: Served
) -> None:
    ledger = Ledger(tmp_path / "metrics.jsonl")
    record = _record("exp", 3, 0.25)
    ledger.write_point(record.rows)
    tensorboard = TensorboardExporter(str(tmp_path / "tb"), None)
    inline, deferred, errors = defer([_wandb(tmp_path), _dead_mlflow(), tensorboard], record, str(ledger.path))
    assert (inline, deferred, errors) == ([tensorboard], ["wandb", "mlflow"], {})

    # W&B got the point from the deliverer; MLflow (nothing listens) is noted on the point's rows
    poll_until(lambda: bool(ledger.read("exp")[0].sink_errors), timeout_s=60, interval_s=0.1, what="the MLflow note")
    [row] = ledger.read("exp")
    assert list(row.sink_errors) == ["mlflow"] and "Connection refused" in row.sink_errors["mlflow"]
    assert row.metrics == {"eval/step": 3.0, "eval/gsm8k": 0.25, "eval/sink_failed_mlflow": 1.0}
    assert history_rows(tmp_path / "wb") == [{"eval/step": 3, "eval/gsm8k": 0.25}]
    poll_until(lambda: outbox.pending() == [], timeout_s=10, interval_s=0.05, what="the envelope removed")
    assert served.deliverer.delivered == 1


def test_the_envelope_is_private_and_holds_what_send_needs_secrets_included(tmp_path: Path, outbox: Outbox) -> None:
    stop = threading.Event()
    with outbox.serving(stop) as serving:  # this test holds the lock: the envelope stays for reading
        assert serving and outbox.served()
        _, deferred, _ = defer([_dead_mlflow()], _record("exp", 4, 0.5), "rel/metrics.jsonl")
        assert deferred == ["mlflow"]
        [path] = outbox.pending()
        assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(outbox.root.stat().st_mode & 0o777) == "0o700"
        env = outbox.read(path)
        assert env.ledger == os.path.abspath("rel/metrics.jsonl")  # the deliverer's cwd may differ
        assert (env.run, env.step, env.flow_run_id) == ("exp", 4, "fr-1")
        [parcel] = env.parcels
        assert parcel.config["token"] == "s3cret" and parcel.lock == "mlflow-exp"
        assert parcel.body["metrics"] == {"eval/step": 4.0, "eval/gsm8k": 0.5} and parcel.body["step"] == 4


def test_a_rerun_that_replaced_the_rows_is_not_marked_by_the_older_points_failure(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox")
    ledger = Ledger(tmp_path / "metrics.jsonl")
    old = _record("exp", 5, 0.1, flow_run_id="fr-old")
    ledger.write_point(old.rows)
    parcel = _dead_mlflow().parcel(old)
    path = outbox.post(Envelope(run="exp", step=5, flow_run_id="fr-old", ledger=str(ledger.path), parcels=[parcel]))
    ledger.write_point(_rows("exp", 5, "fr-new", 0.9))  # the rerun, before the deliverer got to it

    errors = Deliverer(outbox).deliver(path)

    assert list(errors) == ["mlflow"]
    [row] = ledger.read("exp")
    assert (row.flow_run_id, row.sink_errors, row.metrics["eval/gsm8k"]) == ("fr-new", {}, 0.9)
    assert outbox.pending() == []


def test_unreadable_envelopes_are_moved_aside_and_the_others_still_go(tmp_path: Path, outbox: Outbox) -> None:
    ledger = Ledger(tmp_path / "metrics.jsonl")
    ledger.write_point(_rows("exp", 6, "fr-1", 0.5))
    (outbox.root / "00000000000000000001-1-0.json").write_text("{not json")
    (outbox.root / "00000000000000000002-1-0.json").symlink_to(tmp_path / "metrics.jsonl")
    good = outbox.post(Envelope(run="exp", step=6, flow_run_id="fr-1", ledger=str(ledger.path),
                                parcels=[_wandb(tmp_path).parcel(_record("exp", 6, 0.5))]))

    assert Deliverer(outbox).deliver_pending(None) == 3

    assert sorted(p.name for p in (outbox.root / REJECTED).iterdir()) == [
        "00000000000000000001-1-0.json", "00000000000000000002-1-0.json"]
    assert not good.exists() and history_rows(tmp_path / "wb") == [{"eval/step": 6, "eval/gsm8k": 0.5}]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1  # the symlink's target untouched


def test_an_outbox_a_neighbour_could_read_is_refused_and_the_point_exports_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "outbox"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    with pytest.raises(UntrustedPathError, match="mode 755, not 0700"):
        Outbox(root)
    monkeypatch.setenv(OUTBOX_ENV, str(root))
    exporters = [_wandb(tmp_path)]
    assert defer(exporters, _record("exp", 1, 0.5), None) == (exporters, [], {})
    out = subprocess.run([sys.executable, "-m", "app.deliverer", str(root)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stderr.strip().count("\n")) == (2, 0), out.stderr
    assert "mode 755, not 0700" in out.stderr and "Traceback" not in out.stderr


def test_one_deliverer_per_outbox_the_second_takes_over_when_the_first_stops(tmp_path: Path, outbox: Outbox) -> None:
    first = Served(outbox)
    second = Deliverer(outbox, poll_s=0.05)
    stop2 = threading.Event()
    t2 = threading.Thread(target=second.run, args=(stop2,), daemon=True)
    t2.start()
    first.stop()  # nothing waits: it stops at once, and the second holds the lock next
    ledger = Ledger(tmp_path / "metrics.jsonl")
    ledger.write_point(_rows("exp", 7, "fr-1", 0.75))
    outbox.post(Envelope(run="exp", step=7, flow_run_id="fr-1", ledger=str(ledger.path),
                         parcels=[_wandb(tmp_path).parcel(_record("exp", 7, 0.75))]))
    poll_until(lambda: second.delivered == 1, timeout_s=60, interval_s=0.05, what="the second deliverer to send")
    stop2.set()
    t2.join(timeout=60)
    assert first.deliverer.delivered == 0
    assert history_rows(tmp_path / "wb") == [{"eval/step": 7, "eval/gsm8k": 0.75}]


_POST = """
import sys
from pinned_eval.sinks import MetricRow, PointRecord
from pinned_eval.sinks.outbox import Outbox, defer
from pinned_eval.sinks.wandb import WandbConfig, WandbExporter
out, wb, proc = sys.argv[1], sys.argv[2], int(sys.argv[3])
exporter = WandbExporter(WandbConfig(project="p", mode="offline", directory=wb), None)
for step in range(proc * 10, proc * 10 + 3):
    rows = [MetricRow(run="exp", step=step, dataset="d", state="measured", metrics={"eval/step": float(step)})]
    assert defer([exporter], PointRecord("exp", step, rows), None)[1] == ["wandb"]
"""


def test_envelopes_from_two_processes_are_each_sent_once_by_a_deliverer_process(tmp_path: Path) -> None:
    """The production shape: a `python -m app.deliverer` process, points posting from two other
    processes at once; SIGTERM lets it finish and exit 0, nothing left in the outbox."""
    root = tmp_path / "outbox"
    outbox = Outbox(root)
    env = {**os.environ, OUTBOX_ENV: str(root), "PYTHONPATH": str(REPO)}
    deliverer = subprocess.Popen([sys.executable, "-m", "app.deliverer", str(root)], cwd=REPO, env=env,
                                 stderr=subprocess.PIPE, text=True)
    try:
        poll_until(outbox.served, timeout_s=60, interval_s=0.05, what="the deliverer process to serve")
        posters = [subprocess.Popen([sys.executable, "-c", _POST, str(root), str(tmp_path / "wb"), str(i)],
                                    cwd=REPO, env=env) for i in (1, 2)]
        assert [p.wait(timeout=120) for p in posters] == [0, 0]
        poll_until(lambda: outbox.pending() == [], timeout_s=120, interval_s=0.1, what="every envelope sent")
    finally:
        deliverer.send_signal(signal.SIGTERM)
        _, err = deliverer.communicate(timeout=60)
    assert deliverer.returncode == 0, err
    steps = sorted(r["eval/step"] for r in history_rows(tmp_path / "wb"))
    assert steps == [10, 11, 12, 20, 21, 22]
    assert not outbox.served() and (root / LOCK_FILE).exists()


def test_a_stopping_deliverer_sends_what_waits_within_its_drain_time(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox")
    for step in (1, 2):
        outbox.post(Envelope(run="exp", step=step, parcels=[_wandb(tmp_path).parcel(_record("exp", step, 0.5))]))
    stop = threading.Event()
    stop.set()  # stopped before it began: it still drains
    deliverer = Deliverer(outbox, drain_s=60)
    deliverer.run(stop)
    assert deliverer.delivered == 2 and outbox.pending() == []
    outbox.post(Envelope(run="exp", step=3, parcels=[_wandb(tmp_path).parcel(_record("exp", 3, 0.5))]))
    Deliverer(outbox, drain_s=0).run(stop)  # no drain time: left for the next deliverer
    assert len(outbox.pending()) == 1
    assert json.loads(outbox.pending()[0].read_text())["step"] == 3


def test_the_worker_command_names_exports_left_waiting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.commands.stack import _note_waiting_exports

    outbox = Outbox(tmp_path / "outbox")
    _note_waiting_exports(outbox.root)
    assert capsys.readouterr().err == ""
    for step in (1, 2):
        outbox.post(Envelope(run="exp", step=step, parcels=[_wandb(tmp_path).parcel(_record("exp", step, 0.5))]))
    (outbox.root / ".tmp-00000000000000000003-1-0.json").write_text("{}")  # a post in progress: not waiting
    _note_waiting_exports(outbox.root)
    assert capsys.readouterr().err == (f"2 tracker export(s) (W&B, MLflow) wait in {outbox.root}: the next "
                                       "`pinned-eval worker` sends them\n")


def test_the_temp_file_of_a_point_killed_before_posting_is_swept_a_live_ones_kept(tmp_path: Path) -> None:
    from pinned_eval import writer_temps

    outbox = Outbox(tmp_path / "outbox")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = writer_temps._start_ticks(child.pid)
        dead = outbox.root / f".tmp-p{child.pid}s{ticks}-00000000000000000001-{child.pid}-0.json"
        dead.write_text("{half")
        mine = outbox.root / writer_temps.temp_name("00000000000000000002-1-0.json")
        mine.write_text("{half")
        Deliverer(outbox).deliver_pending(None)
        assert dead.exists() and mine.exists(), "writers alive: both kept, neither read"
    finally:
        child.kill()
        child.wait()
    assert Deliverer(outbox).deliver_pending(None) == 0
    assert not dead.exists() and mine.exists() and outbox.pending() == []
