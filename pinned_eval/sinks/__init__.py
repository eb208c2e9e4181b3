"""Where a point's record goes: the ledger first, then every exporter (no Prefect here).

- The **ledger** (`ledger.Ledger`, a JSONL file named by the sinks block's `jsonl_path`) is the
  record: written first, its failure fails the log task, and it is the only sink anything reads
  back. It is not an exporter, so no configuration can switch it off by accident.
- An **exporter** is a best-effort mirror of the record (`Exporter`), one module per tracker: W&B
  (`sinks.wandb`), MLflow (`sinks.mlflow`), TensorBoard (`sinks.tensorboard`), the samples file
  (`tasks.results`), the Prefect artifacts (`tasks.artifacts`). Each is registered
  once by name in `EXPORTERS` (`register_exporter`; a second registration of a name raises) with
  a factory that builds it from the sinks block's settings, or returns None when not configured,
  and an `order` (the samples file before W&B and the artifacts, which link or read it).
- `export_all` runs each exporter with `attempt_sink` (`SINK_ATTEMPTS`, exponential backoff) and
  returns {name: error} for those that still failed; the log task notes them in the ledger. An
  exporter's `exclusive(record)` names a lock (limit 1) the caller holds around each attempt
  (`hold`: the Prefect side passes `tasks.admission.exclusive`). Only `Exception`s are caught.
- A **deferrable** exporter (W&B, MLflow: remote trackers) is `parcel` (on the point) then `send`
  (anywhere); under a worker, `outbox.defer` hands the parcels to the worker's deliverer
  (`delivery.Deliverer`), which sends them off the point's path and notes failures in the ledger.
"""

from __future__ import annotations

from pinned_eval.sinks.exporters import (
    EXPORTERS,
    SINK_ATTEMPTS,
    SINK_FAILED,
    BaseExporter,
    Exporter,
    PointRecord,
    PointSamples,
    SinkSettings,
    attempt_sink,
    build_exporters,
    close_all,
    export_all,
    register_exporter,
    with_sink_errors,
)
from pinned_eval.sinks.ledger import JsonlSink, Ledger, MetricRow
from pinned_eval.sinks.mlflow import MlflowExporter, mlflow_key
from pinned_eval.sinks.tensorboard import TensorboardExporter
from pinned_eval.sinks.wandb import WandbWriter, log_to_wandb, shared_writer_settings, wandb_eval_run_id

__all__ = [
    "EXPORTERS",
    "SINK_ATTEMPTS",
    "SINK_FAILED",
    "BaseExporter",
    "Exporter",
    "JsonlSink",
    "Ledger",
    "MetricRow",
    "MlflowExporter",
    "PointRecord",
    "PointSamples",
    "SinkSettings",
    "TensorboardExporter",
    "WandbWriter",
    "attempt_sink",
    "build_exporters",
    "close_all",
    "export_all",
    "log_to_wandb",
    "mlflow_key",
    "register_exporter",
    "shared_writer_settings",
    "wandb_eval_run_id",
    "with_sink_errors",
]
