"""Every registered exporter, against its own backend read back (`pinned_eval.sinks.EXPORTERS`).

One contract for each: built from a sinks block that configures every exporter, it names itself,
declares its lock, exports one measured point with nothing to report, and what it wrote reads back
exactly: W&B offline run files (`tests.wandb_offline`), a real MLflow tracking server
(`tests.mlflow_server`, read back through `MlflowClient`), TensorBoard event files (read back with
TensorBoard's own `EventAccumulator`), the samples Parquet file, the Prefect artifacts. A newly
registered exporter fails `test_every_exporter_is_read_back` until it gets a reader here. Also: a
sinks block document saved with today's fields loads and builds them all.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, cast

import pytest
from prefect import flow
from prefect.artifacts import Artifact
from pydantic import SecretStr

import tasks.log  # noqa: F401 - importing it registers the Prefect-side exporters
from blocks import SinksBlock
from pinned_eval.external import DatasetResult, results_from_rows, samples_artifact_key
from pinned_eval.points import history_artifact_key
from pinned_eval.results.store import SAMPLES
from pinned_eval.results.tables import table_key
from pinned_eval.sinks import EXPORTERS, Ledger, MetricRow, PointRecord, PointSamples, build_exporters, export_all
from tasks.results import write_sample_rows
from tests.mlflow_server import MlflowServer, served
from tests.tensorboard_events import scalars
from tests.wandb_offline import history_rows, logged_tables, runs

STEP = 4


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    yield from served(tmp_path_factory)


def _sample_row(ds: str, example: int, sample: int, reward: float) -> dict[str, Any]:
    return {
        "dataset": ds,
        "example_id": example,
        "sample_index": sample,
        "prompt": f"{example}+1=",
        "response": f"{example + 1}",
        "reward": reward,
        "label": json.dumps(str(example + 1)),
        "metadata": "{}",
        "weight_version": str(STEP),
        "finish_reason": "stop",
        "prompt_tokens": 3,
        "completion_tokens": 1,
    }


RESULTS = {
    "add": DatasetResult(
        rewards=[1.0, 0.0, 1.0],
        truncated=[False, False, True],
        weight_versions=[str(STEP)] * 3,
        response_lens=[1, 1, 8],
    )
}
SAMPLE_ROWS = [_sample_row("add", 0, 0, 1.0), _sample_row("add", 1, 0, 0.0), _sample_row("add", 2, 0, 1.0)]


def _sinks(tmp_path: Path, mlflow_url: str) -> SinksBlock:
    return SinksBlock(
        jsonl_path=str(tmp_path / "metrics.jsonl"),
        results_root=str(tmp_path / "results"),
        wandb_project="p",
        wandb_mode="offline",
        wandb_dir=str(tmp_path / "wandb"),
        wandb_samples_per_dataset=2,
        mlflow_tracking_uri=mlflow_url,
        mlflow_samples_per_dataset=2,
        tensorboard=True,
    )


def _record(run: str) -> PointRecord:
    rows = [
        MetricRow(
            run=run,
            step=STEP,
            dataset="add",
            state="measured",
            weight_version=str(STEP),
            metrics={"eval/add": 0.6667, "eval/step": STEP},
        )
    ]
    return PointRecord(run, STEP, rows, None, PointSamples(results=RESULTS, rows=SAMPLE_ROWS, key="k1"))


def _data(artifact: Artifact) -> list[dict[str, Any]]:
    return cast(list[dict[str, Any]], json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data)


def _read_wandb(sinks: SinksBlock, record: PointRecord) -> None:
    wandb_dir = Path(cast(str, sinks.wandb_dir))
    assert runs(wandb_dir) == [{"id": f"{record.run}-eval", "group": record.run, "job_type": "eval"}]
    assert [{k: v for k, v in r.items() if not k.startswith("eval/samples")} for r in history_rows(wandb_dir)] == [
        {"eval/add": 0.6667, "eval/step": STEP}
    ]
    table = logged_tables(wandb_dir)["eval/samples/add"]
    assert table["columns"][:4] == ["example_id", "sample_index", "prompt", "response"]
    assert [row[:5] for row in table["data"]] == [[0, 0, "0+1=", "1", 1.0], [1, 0, "1+1=", "2", 0.0]]  # first 2


def _read_mlflow(sinks: SinksBlock, record: PointRecord) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=sinks.mlflow_tracking_uri)
    experiment = client.get_experiment_by_name("pinned-eval")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id], filter_string=f"tags.`pinned_eval.run` = '{record.run}'")
    assert (run.info.run_name, run.info.status) == (f"{record.run}-eval", "FINISHED")
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] for k in run.data.metrics}
    assert history == {"eval/add": [(STEP, 0.6667)], "eval/step": [(STEP, STEP)]}
    table = json.loads(Path(client.download_artifacts(run.info.run_id, f"eval/samples/step_{STEP:08d}/add.json")
                            ).read_text())
    assert table["columns"][:4] == ["example_id", "sample_index", "prompt", "response"]
    assert [row[:5] for row in table["data"]] == [[0, 0, "0+1=", "1", 1.0], [1, 0, "1+1=", "2", 0.0]]  # first 2


def _read_tensorboard(sinks: SinksBlock, record: PointRecord) -> None:
    logdir = Path(cast(str, sinks.results_root)) / record.run / "tensorboard"
    assert scalars(logdir) == {"eval/add": [(STEP, 0.6667)], "eval/step": [(STEP, STEP)]}
    assert [oct(p.stat().st_mode & 0o777) for p in (logdir.parent, logdir)] == ["0o700", "0o700"]  # made private


def _read_results(sinks: SinksBlock, record: PointRecord) -> None:
    store = sinks.results_store()
    assert store is not None
    table = store.read(record.run, STEP, SAMPLES)
    assert table.to_pylist() == SAMPLE_ROWS
    assert table_key(table) == "k1"


def _read_samples(sinks: SinksBlock, record: PointRecord) -> None:
    artifact = Artifact.get(samples_artifact_key(record.run, STEP))
    assert artifact is not None
    assert results_from_rows(_data(artifact)) == RESULTS


def _read_artifacts(sinks: SinksBlock, record: PointRecord) -> None:
    store = sinks.results_store()
    assert store is not None
    point = Artifact.get(f"{history_artifact_key(record.run)}-step-{STEP}")
    assert point is not None
    assert _data(point) == [
        {"dataset": "add", "state": "measured", "reason": "", "eval/add": 0.6667, "eval/step": STEP}
    ]
    assert point.description == (
        f"eval point {record.run}/step-{STEP}; samples: "
        f"[{store.url(record.run, STEP, SAMPLES)}]({store.link(record.run, STEP, SAMPLES)})"
    )
    history = Artifact.get(history_artifact_key(record.run))
    assert history is not None
    assert _data(history) == [
        {
            "step": STEP,
            "state": "measured",
            "reason": "",
            "weight_version": str(STEP),
            "lag_steps": "",
            "eval/add": 0.6667,
        }
    ]


@flow(name="exporter-probe", validate_parameters=False)
def _export_in_a_flow_run(exporter: Any, record: Any, hold: Any) -> dict[str, str]:
    """As the log task does: inside a run (artifacts belong to one)."""
    return export_all([exporter], record, hold=hold)


READ_BACK: dict[str, Callable[[SinksBlock, PointRecord], None]] = {
    "results": _read_results,
    "samples": _read_samples,
    "wandb": _read_wandb,
    "mlflow": _read_mlflow,
    "tensorboard": _read_tensorboard,
    "artifacts": _read_artifacts,
}


def test_every_exporter_is_read_back() -> None:
    assert sorted(EXPORTERS) == sorted(READ_BACK)
    assert [name for name, _ in sorted(EXPORTERS.items(), key=lambda kv: kv[1].order)] == [
        "results",
        "samples",
        "wandb",
        "mlflow",
        "tensorboard",
        "artifacts",  # the samples file before those that read or link it
    ]


@pytest.mark.parametrize("name", sorted(EXPORTERS))
def test_an_exporter_writes_what_reads_back(
    prefect_server: str, mlflow_server: MlflowServer, tmp_path: Path, name: str
) -> None:
    sinks = _sinks(tmp_path, mlflow_server.url)
    record = _record(f"x{uuid.uuid4().hex[:8]}")
    [exporter] = [e for e in build_exporters(sinks) if e.name == name]
    tb_dir = str(tmp_path / "results" / record.run / "tensorboard")
    lock = {
        "wandb": f"wandb-{record.run}-eval",
        "mlflow": f"mlflow-{record.run}",
        "tensorboard": f"tensorboard-{hashlib.sha256(tb_dir.encode()).hexdigest()[:16]}",
    }.get(name)
    assert exporter.exclusive(record) == lock
    store = sinks.results_store()
    assert store is not None
    if name != "results":  # what the `results` exporter, registered first, leaves for the others
        write_sample_rows(store, record.run, STEP, SAMPLE_ROWS, "k1", link=False)
    Ledger(cast(str, sinks.jsonl_path)).write_point(record.rows)  # written first, as the log task does
    held: list[str] = []

    def hold(lock_name: str) -> AbstractContextManager[None]:
        held.append(lock_name)
        return nullcontext()

    assert _export_in_a_flow_run(exporter, record, hold) == {}
    exporter.close()
    assert held == ([lock] if lock else [])
    READ_BACK[name](sinks, record)


def test_a_failing_exporter_is_retried_then_named_and_the_others_still_run(tmp_path: Path) -> None:
    calls: list[str] = []

    class Broken:
        name = "broken"

        def exclusive(self, record: PointRecord) -> str | None:
            return None

        def export(self, record: PointRecord) -> None:
            calls.append(self.name)
            raise OSError("disk full")

        def describe_failure(self, error: str) -> str:
            return f"nothing written ({error})"

        def close(self) -> None:
            pass

    class Fine(Broken):
        name = "fine"

        def export(self, record: PointRecord) -> None:
            calls.append(self.name)

    errors = export_all([Broken(), Fine()], _record("r"))
    assert errors == {"broken": "nothing written (OSError: disk full)"}
    assert calls == ["broken", "broken", "broken", "fine"]


def test_a_duplicate_exporter_name_is_refused() -> None:
    from pinned_eval.sinks import register_exporter

    with pytest.raises(ValueError, match="exporter 'wandb' is already registered"):
        register_exporter("wandb", lambda settings: None)


def test_a_sinks_block_saved_with_todays_fields_loads_and_builds_every_exporter(
    prefect_server: str, tmp_path: Path
) -> None:
    name = f"sinks-{uuid.uuid4().hex[:8]}"
    fields = {
        "jsonl_path": str(tmp_path / "m.jsonl"),
        "wandb_project": "proj",
        "wandb_entity": "team",
        "wandb_run_id": "train-7",
        "wandb_writer": "eval_run",
        "wandb_mode": "offline",
        "wandb_dir": str(tmp_path / "wandb"),
        "results_root": str(tmp_path / "results"),
        "results_endpoint_url": None,
        "wandb_samples_per_dataset": 3,
        "mlflow_tracking_uri": "http://127.0.0.1:5000",
        "mlflow_experiment": "rl",
        "mlflow_run_id": "0123abcd",
        "mlflow_username": "alice",
        "mlflow_samples_per_dataset": 4,
        "tensorboard": True,
        "tensorboard_dir": str(tmp_path / "tb"),
    }
    secrets = {"mlflow_password": SecretStr("pw-9f3"), "mlflow_token": SecretStr("tok-5e1")}
    SinksBlock(**fields, **secrets).save(name)
    loaded = cast(SinksBlock, SinksBlock.load(name))
    assert loaded.model_dump(include=set(fields)) == fields
    assert {k: cast(SecretStr, getattr(loaded, k)).get_secret_value() for k in secrets} == {
        "mlflow_password": "pw-9f3", "mlflow_token": "tok-5e1"}
    exporters = build_exporters(loaded)
    assert [e.name for e in exporters] == ["results", "samples", "wandb", "mlflow", "tensorboard", "artifacts"]
    wandb, mlflow = exporters[2], exporters[3]
    assert wandb.exclusive(_record("exp")) == "wandb-train-7-eval"
    assert mlflow.exclusive(_record("exp")) is None  # into the trainer's run: no find-or-create
    assert SinksBlock.load(name).wandb_samples_per_dataset == 3  # type: ignore[attr-defined]
    bare = build_exporters(SinksBlock())  # nothing configured: the artifacts and samples artifact only
    assert [e.name for e in bare] == ["samples", "artifacts"]


def test_mlflow_finds_its_own_run_again_by_its_tag_in_a_new_process(mlflow_server: MlflowServer) -> None:
    """One run per training run, not per point: a process that has not seen the run (its memory of
    found runs cleared) finds the run the first point created by its `pinned_eval.run` tag."""
    from mlflow import MlflowClient

    from pinned_eval.sinks import mlflow as mlflow_sink

    run = f"x{uuid.uuid4().hex[:8]}"
    exporter = mlflow_sink.MlflowExporter(mlflow_sink.MlflowConfig(tracking_uri=mlflow_server.url, experiment=run))
    for step in (4, 6):
        mlflow_sink._OWN_RUNS.clear()
        row = MetricRow(run=run, step=step, dataset="add", state="measured", metrics={"eval/add": step / 10})
        assert export_all([exporter], PointRecord(run, step, [row])) == {}
    client = MlflowClient(tracking_uri=mlflow_server.url)
    experiment = client.get_experiment_by_name(run)
    assert experiment is not None
    [found] = client.search_runs([experiment.experiment_id])
    assert found.data.tags["pinned_eval.run"] == run
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "eval/add")] == [(4, 0.4), (6, 0.6)]
