"""Results tasks: the generation cache around the fleet, and the point's samples file.

Contract:
- `cached_generations` returns the generations stored for (run, step) when they were written for
  that point (`ResultsStore.read`) under the same cache key (`pinned_eval.results.cache.generation_key`),
  else None (a file of another point, or one under a directory another user controls, is logged
  and generated anew, never used); a point that gets
  them skips pin and generate (no fleet lock, no request) and only scores and logs;
- `store_generations` writes them right after generation, before scoring, so a point whose
  scoring or logging fails leaves them for its rerun; a failure to write is logged (WARNING) and
  the point goes on uncached;
- `write_samples` writes the scored samples and links them from the point's `samples-file` link
  artifact; for a measured point it runs as the `results` exporter (`ResultsExporter`, with a
  results store configured), after the ledger like the others (`pinned_eval.sinks.export_all`; a
  failure marks the rows `eval/sink_failed_results: 1`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact
from prefect.cache_policies import NO_CACHE

from pinned_eval.points import history_artifact_key
from pinned_eval.results.store import GENERATIONS, SAMPLES, ResultsKeyError, ResultsStore
from pinned_eval.results.tables import generation_fields, generation_row, generations_table, samples_table, table_key
from pinned_eval.sinks import BaseExporter, PointRecord, SinkSettings, register_exporter
from pinned_eval.trusted_paths import UntrustedPathError
from tasks.generate import Generation


def samples_link_key(run: str, step: int) -> str:
    """The link artifact pointing at a point's samples file."""
    return f"{history_artifact_key(run)}-step-{step}-samples-file"


@task(cache_policy=NO_CACHE, task_run_name="cached-generations-{step}")
def cached_generations(store: ResultsStore, run: str, step: int, key: str) -> list[Generation] | None:
    if not store.exists(run, step, GENERATIONS):
        return None
    try:
        table = store.read(run, step, GENERATIONS)
    except (ResultsKeyError, UntrustedPathError) as exc:
        get_run_logger().warning("stored generations of %s/step-%d refused (generating anew): %s", run, step, exc)
        return None
    if table_key(table) != key:
        get_run_logger().info("stored generations of %s/step-%d have another key; generating anew", run, step)
        return None
    gens = [Generation(**generation_fields(r)) for r in table.to_pylist()]
    get_run_logger().info("reusing %d stored generations of %s/step-%d (key %s)", len(gens), run, step, key[:12])
    return gens


@task(cache_policy=NO_CACHE, task_run_name="store-generations-{step}")
def store_generations(store: ResultsStore, run: str, step: int, key: str, generations: list[Generation]) -> None:
    try:
        table = generations_table((generation_row(g.model_dump()) for g in generations), key)
        store.write(run, step, GENERATIONS, table)
    except Exception as exc:  # the cache is an optimisation: the point goes on, uncached, and says so
        get_run_logger().warning(
            "generations of %s/step-%d not stored (a rerun will regenerate): %s: %s", run, step, type(exc).__name__, exc
        )


def write_samples(
    store: ResultsStore,
    run: str,
    step: int,
    generations: Sequence[Generation],
    rewards: Mapping[tuple[str, int, int], float | None],
    key: str | None,
    *,
    rescored: bool = False,
    link: bool = True,
) -> str:
    """Write the samples file of (run, step); returns its url. `rewards` by (dataset, example, sample).
    `link`: create the point's link artifact (inside a flow or task run; a rescore keeps the point's)."""
    return write_sample_rows(store, run, step, sample_rows(generations, rewards), key, rescored=rescored, link=link)


def sample_rows(
    generations: Sequence[Generation], rewards: Mapping[tuple[str, int, int], float | None]
) -> list[dict[str, Any]]:
    """The samples file's rows: each generation's row with its reward."""
    rows = []
    for g in generations:
        row = generation_row(g.model_dump())
        row["reward"] = rewards[g.dataset, g.prompt_index, g.sample_index]
        rows.append(row)
    return rows


def write_sample_rows(
    store: ResultsStore,
    run: str,
    step: int,
    rows: list[dict[str, Any]],
    key: str | None,
    *,
    rescored: bool = False,
    link: bool = True,
) -> str:
    url = store.write(run, step, SAMPLES, samples_table(rows, key=key, rescored=rescored))
    if not link:
        return url
    create_link_artifact(
        link=store.link(run, step, SAMPLES),
        link_text=f"samples of {run}/step-{step}",
        key=samples_link_key(run, step),
        description=f"per-sample generations and rewards of eval point {run}/step-{step} (Parquet)",
    )
    return url


class ResultsExporter(BaseExporter):
    """The samples file of a measured point (`write_samples`), when the point has samples."""

    name = "results"

    def __init__(self, store: ResultsStore) -> None:
        self.store = store

    def export(self, record: PointRecord) -> None:
        if record.samples is not None:
            write_sample_rows(self.store, record.run, record.step, record.samples.rows, record.samples.key)

    def describe_failure(self, error: str) -> str:
        return f"samples file not written ({error})"


def _results(settings: SinkSettings) -> ResultsExporter | None:
    store = settings.results_store()
    return ResultsExporter(store) if store is not None else None


register_exporter("results", _results, order=10)  # first: the W&B tables and the point's table read it
