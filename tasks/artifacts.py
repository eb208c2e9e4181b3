"""The Prefect artifacts exporters: the point's table, the run's history, the samples artifact.

- `artifacts` (always on): a table per point (`eval-<run>-step-<step>`; its description links
  the samples file when the point wrote one) and the run's history table `eval-<run>` (one row per
  step, newest record wins), a new version of it per point. With a ledger the history is rebuilt
  from it, so it also holds the skips the trainer recorded itself (`busy`, `export_failed`: no
  flow ran for them); without one it is the previous version plus this point.
- `samples` (a measured point with samples): the table artifact `samples_artifact_key(run, step)`
  with the per-sample results (`pinned_eval.external.sample_rows`), which the miles adapter reads
  back. `record_point_samples` is usable by any posture (the external one calls it itself).
Both run inside a flow or task run (`pinned_eval.sinks.export_all`, from the log task). Secrets
never enter a row or an artifact.
"""

from __future__ import annotations

import json
from typing import Any, cast

from prefect.artifacts import Artifact, create_table_artifact

from pinned_eval.external import DatasetResult, sample_rows, samples_artifact_key
from pinned_eval.points import history_artifact_key
from pinned_eval.results.store import SAMPLES, ResultsStore
from pinned_eval.sinks import BaseExporter, Ledger, MetricRow, PointRecord, SinkSettings, register_exporter


def record_point_samples(run: str, step: int, data: dict[str, DatasetResult]) -> None:
    """Publish a point's per-sample results (call inside a flow or task run)."""
    create_table_artifact(
        table=sample_rows(data),
        key=samples_artifact_key(run, step),
        description=f"per-sample results of eval point {run}/step-{step}",
    )


def history_row(rows: list[MetricRow]) -> dict[str, Any]:
    first = rows[0]
    row: dict[str, Any] = {
        "step": first.step,
        "state": first.state,
        "reason": first.reason or "",
        "weight_version": first.weight_version or "",
        "lag_steps": first.metrics.get("eval/lag_steps", ""),
    }
    for r in rows:
        if r.dataset is not None:
            row[f"eval/{r.dataset}"] = round(r.metrics.get(f"eval/{r.dataset}", float("nan")), 4)
    return row


def update_history(run: str, rows: list[MetricRow], jsonl_path: str | None) -> None:
    key = history_artifact_key(run)
    table: list[dict[str, Any]] = []
    if jsonl_path:
        by_step: dict[int, list[MetricRow]] = {}
        for r in Ledger(jsonl_path).read(run):  # this point's rows are already in it
            by_step.setdefault(r.step, []).append(r)
        table = [history_row(step_rows) for _, step_rows in sorted(by_step.items())]
    else:
        previous = cast(Artifact | None, Artifact.get(key))
        if previous is not None and previous.data:
            raw = json.loads(previous.data) if isinstance(previous.data, str) else previous.data
            data = cast(list[dict[str, Any]], raw)
            table = [r for r in data if r.get("step") != rows[0].step]
        table.append(history_row(rows))
        table.sort(key=lambda r: r["step"])
    create_table_artifact(table=table, key=key, description=f"eval history of run {run}, one row per step")


class ArtifactsExporter(BaseExporter):
    name = "artifacts"

    def __init__(self, jsonl_path: str | None, store: ResultsStore | None) -> None:
        self.jsonl_path = jsonl_path
        self.store = store

    def export(self, record: PointRecord) -> None:
        run, step, rows = record.run, record.step, record.rows
        description = f"eval point {run}/step-{step}"
        store = self.store
        if store is not None and record.measured and store.exists(run, step, SAMPLES):
            description += f"; samples: [{store.url(run, step, SAMPLES)}]({store.link(run, step, SAMPLES)})"
        create_table_artifact(
            table=[{"dataset": r.dataset or "", "state": r.state, "reason": r.reason or "", **r.metrics} for r in rows],
            key=f"{history_artifact_key(run)}-step-{step}",
            description=description,
        )
        update_history(run, rows, self.jsonl_path)


class SamplesArtifactExporter(BaseExporter):
    name = "samples"

    def export(self, record: PointRecord) -> None:
        if record.samples is not None:
            record_point_samples(record.run, record.step, record.samples.results)

    def describe_failure(self, error: str) -> str:
        return f"per-sample artifact not written ({error})"


register_exporter("samples", lambda s: SamplesArtifactExporter(), order=20)
register_exporter("artifacts", lambda s: _artifacts(s), order=40)


def _artifacts(settings: SinkSettings) -> ArtifactsExporter:
    return ArtifactsExporter(settings.jsonl_path, settings.results_store())
