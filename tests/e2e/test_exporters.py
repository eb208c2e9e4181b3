"""Every registered exporter, against its own backend read back (`pinned_eval.sinks.EXPORTERS`).

One contract for each: built from a sinks block that configures every exporter, it names itself,
declares its lock, exports one measured point with nothing to report, and what it wrote reads back
exactly: W&B offline run files (`tests.wandb_offline`), the samples Parquet file, the Prefect
artifacts. A newly registered exporter fails `test_every_exporter_is_read_back` until it gets a
reader here. Also: a sinks block document saved with today's fields loads and builds them all.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, cast

import pytest
from prefect import flow
from prefect.artifacts import Artifact

import tasks.log  # noqa: F401 - importing it registers the Prefect-side exporters
from blocks import SinksBlock
from pinned_eval.external import DatasetResult, results_from_rows, samples_artifact_key
from pinned_eval.points import history_artifact_key
from pinned_eval.results.store import SAMPLES
from pinned_eval.results.tables import table_key
from pinned_eval.sinks import EXPORTERS, Ledger, MetricRow, PointRecord, PointSamples, build_exporters, export_all
from tasks.results import write_sample_rows
from tests.wandb_offline import history_rows, logged_tables, runs

STEP = 4


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


def _sinks(tmp_path: Path) -> SinksBlock:
    return SinksBlock(
        jsonl_path=str(tmp_path / "metrics.jsonl"),
        results_root=str(tmp_path / "results"),
        wandb_project="p",
        wandb_mode="offline",
        wandb_dir=str(tmp_path / "wandb"),
        wandb_samples_per_dataset=2,
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
    "artifacts": _read_artifacts,
}


def test_every_exporter_is_read_back() -> None:
    assert sorted(EXPORTERS) == sorted(READ_BACK)
    assert [name for name, _ in sorted(EXPORTERS.items(), key=lambda kv: kv[1].order)] == [
        "results",
        "samples",
        "wandb",
        "artifacts",  # the samples file before those that read or link it
    ]


@pytest.mark.parametrize("name", sorted(EXPORTERS))
def test_an_exporter_writes_what_reads_back(prefect_server: str, tmp_path: Path, name: str) -> None:
    sinks = _sinks(tmp_path)
    record = _record(f"x{uuid.uuid4().hex[:8]}")
    [exporter] = [e for e in build_exporters(sinks) if e.name == name]
    lock = {"wandb": f"wandb-{record.run}-eval"}.get(name)
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
    }
    SinksBlock(**fields).save(name)
    loaded = cast(SinksBlock, SinksBlock.load(name))
    assert loaded.model_dump(include=set(fields)) == fields
    exporters = build_exporters(loaded)
    assert [e.name for e in exporters] == ["results", "samples", "wandb", "artifacts"]
    wandb = exporters[2]
    assert wandb.exclusive(_record("exp")) == "wandb-train-7-eval"
    assert SinksBlock.load(name).wandb_samples_per_dataset == 3  # type: ignore[attr-defined]
    bare = build_exporters(SinksBlock())  # nothing configured: the artifacts and samples artifact only
    assert [e.name for e in bare] == ["samples", "artifacts"]
