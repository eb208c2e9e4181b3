"""MLflow and TensorBoard sinks before any point: refusals when the sinks block loads (missing extra,
no place to write, half a credential), in the user's words on `block save` and `block apply`;
credentials from the environment of `block save` only, masked in every repr, sent to the server
as MLflow's own header and never left in the worker's environment; metric names MLflow accepts;
an untrusted TensorBoard directory refused by the exporter (an error beside the point)."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import SecretStr, ValidationError
from typer.testing import CliRunner

from app.block_specs import build_block
from app.cli import app
from blocks import SinksBlock
from pinned_eval.sinks import Exporter, MetricRow, PointRecord, build_exporters, export_all, mlflow_key
from pinned_eval.sinks.mlflow import MlflowConfig, MlflowExporter

URL = "http://127.0.0.1:5000"


def _trackers(block: SinksBlock) -> list[Exporter]:
    """The block's MLflow and TensorBoard exporters (the Prefect-side ones register when `tasks` is imported)."""
    return [e for e in build_exporters(block) if e.name in ("mlflow", "tensorboard")]


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.mark.parametrize(("module", "fields", "message"), [
    ("mlflow", {"mlflow_tracking_uri": URL},
     "mlflow_tracking_uri: needs the optional package 'mlflow': pip install 'pinned-eval[mlflow]'"),
    ("tensorboard", {"tensorboard_dir": "/tmp/tb"},
     "tensorboard_dir: needs the optional package 'tensorboard': pip install 'pinned-eval[tensorboard]'"),
    ("tensorboard", {"tensorboard": True, "results_root": "/tmp/r"},
     "tensorboard: needs the optional package 'tensorboard': pip install 'pinned-eval[tensorboard]'"),
])
def test_a_block_needing_a_missing_extra_is_refused_when_it_loads(
    here: Path, monkeypatch: pytest.MonkeyPatch, module: str, fields: dict[str, object], message: str
) -> None:
    SinksBlock.model_validate(fields)  # installed: accepted
    monkeypatch.setitem(sys.modules, module, None)  # as if the extra were not installed
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SinksBlock.model_validate(fields)  # what `SinksBlock.load` runs on the saved document
    flag = next(iter(fields))
    args = [f"--{flag.replace('_', '-')}"] + ([] if fields[flag] is True else [str(fields[flag])])
    if "results_root" in fields:
        args += ["--results-root", "/tmp/r"]
    assert cli("block", "save", "sinks", "default", *args) == (2, f"error: --{_flagged(message)}\n")
    (here / "pinned-eval.yaml").write_text("sinks:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in fields.items()))
    code, out = cli("block", "apply", "pinned-eval.yaml")
    assert (code, out.strip()) == (2, f"error: pinned-eval.yaml: sinks.{message}")


def _flagged(message: str) -> str:
    field, _, rest = message.partition(": ")
    return f"{field.replace('_', '-')}: {rest}"


@pytest.mark.parametrize(("fields", "message"), [
    ({"mlflow_tracking_uri": "file:///tmp/mlruns"},
     "mlflow_tracking_uri: 'file:///tmp/mlruns' is not an http(s):// URL of an MLflow tracking server"),
    ({"mlflow_tracking_uri": URL, "mlflow_username": "alice"},
     "mlflow_username: basic auth needs both mlflow_username and mlflow_password"),
    ({"tensorboard": True}, "tensorboard: needs tensorboard_dir (the trainer's log directory) or a local "
                            "results_root to write <results_root>/<run>/tensorboard"),
    ({"tensorboard": True, "results_root": "s3://b/r"}, "tensorboard: needs tensorboard_dir (the trainer's log "
                                                        "directory) or a local results_root to write "
                                                        "<results_root>/<run>/tensorboard"),
    ({"tensorboard_dir": "runs/x"}, "tensorboard_dir: 'runs/x' is not an absolute local directory"),
])
def test_tracker_fields_that_cannot_work_are_refused_naming_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as exc:
        SinksBlock.model_validate(fields)
    assert exc.value.errors()[0]["msg"] == f"Value error, {message}"


def test_save_flags_and_a_relative_tensorboard_dir(here: Path) -> None:
    block = build_block("sinks", {"mlflow_tracking_uri": URL, "mlflow_experiment": "rl", "mlflow_run_id": "abc",
                                  "mlflow_samples_per_dataset": 5, "tensorboard_dir": "runs/exp1"}, here, "x")
    assert isinstance(block, SinksBlock)
    assert (block.mlflow_tracking_uri, block.mlflow_experiment, block.mlflow_run_id,
            block.mlflow_samples_per_dataset, block.tensorboard_dir) == (URL, "rl", "abc", 5, str(here / "runs/exp1"))
    assert [e.name for e in _trackers(block)] == ["mlflow", "tensorboard"]
    assert cli("block", "save", "sinks", "default", "--tensorboard") == (
        2, "error: --tensorboard: needs tensorboard_dir (the trainer's log directory) or a local results_root to "
           "write <results_root>/<run>/tensorboard\n")


def test_credentials_come_from_the_environment_only_and_are_masked(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = cli("block", "save", "sinks", "default", "--mlflow-tracking-uri", URL, "--mlflow-token", "t")
    assert code == 2 and "No such option: --mlflow-token" in out  # no secret on a command line
    fields = {"mlflow_tracking_uri": URL, "mlflow_credentials_from_env": True}
    with pytest.raises(Exception, match="mlflow_credentials_from_env: neither MLFLOW_TRACKING_TOKEN nor "
                                        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD set"):
        build_block("sinks", fields, here, "x")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-5e1")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw-9f3")
    block = build_block("sinks", fields, here, "x")
    assert isinstance(block, SinksBlock)
    assert block.mlflow_token == SecretStr("tok-5e1") and block.mlflow_password == SecretStr("pw-9f3")
    assert block.mlflow_username == "alice"
    [exporter] = _trackers(block)
    for text in (repr(block), str(block), repr(exporter.__dict__), block.model_dump_json()):
        assert "tok-5e1" not in text and "pw-9f3" not in text


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict[str, str | None]]] = []

    def do_GET(self) -> None:
        type(self).seen.append({"path": self.path, "authorization": self.headers.get("Authorization")})
        body = json.dumps({"error_code": "INTERNAL_ERROR", "message": "recorder"}).encode()
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_blocks_token_is_sent_and_the_workers_own_is_neither_used_nor_changed(
    recorder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "the-workers-own")
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    exporter = MlflowExporter(MlflowConfig(tracking_uri=recorder, token=SecretStr("tok-5e1")))
    row = MetricRow(run="r", step=3, dataset="d", state="measured", metrics={"eval/d": 0.5})
    errors = export_all([exporter], PointRecord("r", 3, [row]))
    assert list(errors) == ["mlflow"] and errors["mlflow"].startswith("MlflowException: "), errors
    assert _Recorder.seen and {s["authorization"] for s in _Recorder.seen} == {"Bearer tok-5e1"}
    assert os.environ["MLFLOW_TRACKING_TOKEN"] == "the-workers-own"
    assert "MLFLOW_TRACKING_USERNAME" not in os.environ


def test_metric_names_mlflow_refuses_are_mapped() -> None:
    assert mlflow_key("eval/gsm8k-pass@4") == "eval/gsm8k-pass_at_4"
    assert mlflow_key("eval/gsm8k/maj@2") == "eval/gsm8k/maj_at_2"
    assert mlflow_key("eval/a b:c.d-e_f") == "eval/a b:c.d-e_f"
    assert mlflow_key("eval/x+y") == "eval/x_y"


def test_an_untrusted_tensorboard_directory_is_an_error_beside_the_point(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # another user could swap what is below it
    [exporter] = _trackers(SinksBlock(tensorboard_dir=str(shared / "tb")))
    row = MetricRow(run="r", step=3, dataset="d", state="measured", metrics={"eval/d": 0.5})
    errors = export_all([exporter], PointRecord("r", 3, [row]))
    assert errors == {"tensorboard": f"UntrustedPathError: TensorBoard log directory '{shared}/tb/eval' refused "
                                     f"('{shared}'): it is writable by others without the sticky bit (mode 777)"}
    assert not (shared / "tb").exists()
