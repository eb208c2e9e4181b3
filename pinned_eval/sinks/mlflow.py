"""The MLflow exporter: a point's metrics at MLflow step = the point's step, beside the training run.

Runs (`SinksBlock.mlflow_*`):
- `mlflow_run_id` set: into the trainer's own MLflow run, as a secondary writer (miles' tracking
  processes do the same): metrics only, its status is never touched; no lock;
- unset: into a run of the training run's own in `mlflow_experiment` (created if missing), named
  `<run>-eval` and tagged `pinned_eval.run = <run>`; the first point creates it, later ones find it
  again by that tag (one run per training run, not per point) and mark it FINISHED after logging.
  Find-or-create has one writer at a time: the exporter declares the lock `mlflow-<run>`
  (`exclusive`), which the log task holds around each attempt. A process remembers the run it
  found (two requests fewer per point) until a write to it fails.

Every metric of the point's ledger rows is logged with one `log_batch` at `step = record.step`
(so `eval/step` too), under the same name, except that characters MLflow refuses in a name
(anything but letters, digits, `_ - . / : space`) are replaced: `@` by `_at_`
(`eval/gsm8k-pass@4` is `eval/gsm8k-pass_at_4`), any other by `_` (`mlflow_key`). With
`mlflow_samples_per_dataset > 0`, a measured point's first N samples per dataset (the W&B table's
columns and order) are the table artifact `eval/samples/step_<step:08d>/<dataset>.json` (MLflow's
table format, `{"columns": [...], "data": [[...]]}`), rewritten, never appended, by a rerun.

Only `mlflow.MlflowClient` with an explicit run id is used (no active run, no global tracking URI),
so points log concurrently in one process. Credentials (`mlflow_token`, or `mlflow_username` +
`mlflow_password`) come from the sinks block only: MLflow reads them from its environment
variables, which are set from the block for the duration of one export (under a process lock)
and restored after, never on a command line; the worker's own `MLFLOW_TRACKING_*` are not used.
HTTP retries are bounded (`HTTP_ENV`): the exporter's own retries (`SINK_ATTEMPTS`) do the rest;
the run's URL is not printed.
The `mlflow` package is imported only when a point is logged.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict, SecretStr

from pinned_eval.sinks import exporters
from pinned_eval.sinks.exporters import BaseExporter, Parcel, PointRecord, SinkSettings
from pinned_eval.sinks.wandb import first_samples

RUN_TAG = "pinned_eval.run"
DEFAULT_EXPERIMENT = "pinned-eval"
BATCH = 1000  # MLflow's limit of metrics per log_batch
CREDENTIAL_ENV = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
_REFUSED = re.compile(r"[^/\w.\- :]")
_ENV_LOCK = threading.Lock()
_OWN_RUNS: dict[tuple[str, str, str], str] = {}  # (tracking URI, experiment, run) -> its own run's id


def mlflow_key(name: str) -> str:
    """`name` as MLflow accepts it: `@` -> `_at_`, any other refused character -> `_`."""
    return _REFUSED.sub("_", name.replace("@", "_at_"))


def samples_artifact(step: int, dataset: str) -> str:
    return f"eval/samples/step_{step:08d}/{dataset}.json"


class MlflowConfig(BaseModel):
    """The MLflow part of the sinks block (its `mlflow_*` fields)."""

    model_config = ConfigDict(frozen=True)

    tracking_uri: str
    experiment: str = DEFAULT_EXPERIMENT
    run_id: str | None = None
    username: str | None = None
    password: SecretStr | None = None
    token: SecretStr | None = None
    samples_per_dataset: int = 0

    @classmethod
    def from_settings(cls, settings: SinkSettings) -> MlflowConfig | None:
        """None when MLflow is off (no tracking URI)."""
        if not settings.mlflow_tracking_uri:
            return None
        return cls(
            tracking_uri=settings.mlflow_tracking_uri,
            experiment=settings.mlflow_experiment,
            run_id=settings.mlflow_run_id,
            username=settings.mlflow_username,
            password=settings.mlflow_password,
            token=settings.mlflow_token,
            samples_per_dataset=settings.mlflow_samples_per_dataset,
        )

    def environment(self) -> dict[str, str | None]:
        """The variables MLflow's client reads during one export (None: unset)."""
        secret = {
            "MLFLOW_TRACKING_TOKEN": self.token.get_secret_value() if self.token else None,
            "MLFLOW_TRACKING_USERNAME": self.username,
            "MLFLOW_TRACKING_PASSWORD": self.password.get_secret_value() if self.password else None,
        }
        return {**secret, **HTTP_ENV}


@contextmanager
def client_environment(values: dict[str, str | None]) -> Iterator[None]:
    """`values` in `os.environ` (None: removed) while the body runs, one body per process at a time."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        try:
            for k, v in values.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            yield
        finally:
            for k, old in saved.items():
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class MlflowExporter(BaseExporter):
    """Deferrable: the parcel holds the metrics under their MLflow names and the sample tables,
    `send` makes the requests."""

    name = "mlflow"
    deferrable = True

    def __init__(self, config: MlflowConfig) -> None:
        self.config = config

    def exclusive(self, record: PointRecord) -> str | None:
        return None if self.config.run_id else f"mlflow-{record.run}"

    def parcel(self, record: PointRecord) -> Parcel:
        merged: dict[str, float] = {}
        for r in record.rows:
            merged.update(r.metrics)
        tables: dict[str, Any] = {}
        if record.measured and record.samples is not None and self.config.samples_per_dataset > 0:
            for ds, (columns, data) in first_samples(record.samples.rows, self.config.samples_per_dataset).items():
                tables[samples_artifact(record.step, ds)] = json.dumps({"columns": columns, "data": data}, default=str)
        body = {"run": record.run, "step": record.step, "time_ms": int(time.time() * 1000),
                "metrics": {mlflow_key(k): float(v) for k, v in merged.items()}, "tables": tables}
        config = exporters.plain_config(self.config)
        return Parcel(exporter=self.name, config=config, lock=self.exclusive(record), body=body)

    def send(self, parcel: Parcel) -> None:
        from mlflow import MlflowClient  # mlflow: optional extra, slow import
        from mlflow.entities import Metric

        body = parcel.body
        run, step, now = body["run"], body["step"], body["time_ms"]
        metrics = [Metric(k, v, now, step) for k, v in body["metrics"].items()]
        own = (self.config.tracking_uri, self.config.experiment, run)
        with client_environment(self.config.environment()):
            client = MlflowClient(tracking_uri=self.config.tracking_uri)
            run_id = self.config.run_id or _OWN_RUNS.get(own) or self.own_run(client, run)
            try:
                for i in range(0, len(metrics), BATCH):
                    client.log_batch(run_id, metrics=metrics[i : i + BATCH])
                for path, table in body["tables"].items():
                    client.log_text(run_id, table, path)
                if not self.config.run_id:
                    client.set_terminated(run_id, "FINISHED")
            except Exception:
                _OWN_RUNS.pop(own, None)  # deleted meanwhile? the retry looks it up again
                raise
            if not self.config.run_id:
                _OWN_RUNS[own] = run_id

    def own_run(self, client: Any, run: str) -> str:
        """The run of `run` in the experiment, found by its tag, else created (under `exclusive`)."""
        from mlflow.exceptions import MlflowException

        experiment = client.get_experiment_by_name(self.config.experiment)
        if experiment is None:
            try:
                experiment_id = client.create_experiment(self.config.experiment)
            except MlflowException:  # created meanwhile by another training run's point
                experiment = client.get_experiment_by_name(self.config.experiment)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        else:
            experiment_id = experiment.experiment_id
        found = client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_TAG}` = {_quoted(run)}", max_results=1,
            order_by=["attributes.start_time ASC"],
        )
        if found:
            return str(found[0].info.run_id)
        created = client.create_run(experiment_id, run_name=f"{run}-eval", tags={RUN_TAG: run})
        return str(created.info.run_id)


def _build(settings: SinkSettings) -> MlflowExporter | None:
    config = MlflowConfig.from_settings(settings)
    return MlflowExporter(config) if config is not None else None


def _restore(config: dict[str, Any]) -> MlflowExporter:
    return MlflowExporter(MlflowConfig.model_validate(config))


exporters.register_exporter("mlflow", _build, order=32, restore=_restore)
