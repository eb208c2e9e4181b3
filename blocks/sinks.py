"""Sinks block: where an eval point's metrics go, besides the Prefect artifacts every point writes.

JSONL rows are keyed (run, step, dataset) and a rerun replaces its rows; W&B rows go beside the
training run without resuming it (a dedicated eval run grouped with it, or shared mode into it)
and are plotted against `eval/step`. With `results_root`, every measured point's samples and
generations go there as Parquet (`pinned_eval.results`; docs/results.md), and W&B gets a table of
`wandb_samples_per_dataset` samples per dataset. MLflow (`mlflow_*`) and TensorBoard
(`tensorboard`, `tensorboard_dir`) follow W&B's rules (docs/blocks.md); a block naming one whose
extra is not installed is refused when it loads (`pip install 'pinned-eval[mlflow]'`). An S3 results
root may instead come from a prefect-aws `S3Bucket` block named by `results_s3_bucket_block`
(`blocks._aws`; not both).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from prefect.blocks.core import Block
from pydantic import Field, PrivateAttr, SecretStr, model_validator

from blocks._aws import require_prefect_aws, resolve_s3_bucket
from blocks._meta import DOCS_URL, LOGO_URL
from pinned_eval.results.store import ResultsStore
from pinned_eval.sinks import WandbWriter
from pinned_eval.sinks.extras import missing_extra
from pinned_eval.sinks.mlflow import DEFAULT_EXPERIMENT
from pinned_eval.snapshot.layout import s3_storage_options


class SinksBlock(Block):
    """Metric sinks for eval points: a JSONL file and, optionally, the training run's W&B run,
    MLflow run and TensorBoard log directory."""

    _block_type_name = "pinned-eval Sinks"
    _block_type_slug = "pinned-eval-sinks"
    _logo_url = LOGO_URL
    _documentation_url = DOCS_URL
    _description = "JSONL, W&B, MLflow and TensorBoard sinks for eval metrics (Prefect artifacts are always written)."
    _code_example = """
    from blocks import SinksBlock

    sinks = SinksBlock.load("BLOCK_NAME")
    print(sinks.jsonl_path)
    """

    jsonl_path: str | None = Field(
        default=None, description="Metrics file; one row per (run, step, dataset), reruns replace rows."
    )
    wandb_project: str | None = Field(default=None, description="W&B project; unset disables W&B.")
    wandb_entity: str | None = Field(default=None, description="W&B entity (team or user).")
    wandb_run_id: str | None = Field(
        default=None, description="W&B run id of the (live) training run; default: the pinned-eval run name."
    )
    wandb_writer: WandbWriter = Field(
        default="eval_run",
        description=(
            "`eval_run`: a dedicated run `<run id>-eval` grouped with the training run (job_type `eval`); "
            "`shared` (online only): W&B shared mode into the training run itself, never resuming it."
        ),
    )
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        default="offline", description="W&B mode; `offline` writes locally for a later `wandb sync`."
    )
    wandb_dir: str | None = Field(default=None, description="Directory for W&B's local files.")
    results_root: str | None = Field(
        default=None,
        description=(
            "Results store: a local directory or `s3://bucket/prefix` for each measured point's samples and "
            "generations (Parquet, `<run>/step_<step:08d>/`); unset: no samples kept, no generation cache."
        ),
    )
    results_endpoint_url: str | None = Field(
        default=None, description="S3 endpoint of an `s3://` results root (credentials: the environment's)."
    )
    wandb_samples_per_dataset: int = Field(
        default=0, ge=0, le=1000, description="Samples per dataset in the point's W&B table (needs results_root)."
    )
    # MLflow and TensorBoard (`pinned_eval.sinks.mlflow`, `pinned_eval.sinks.tensorboard`)
    mlflow_tracking_uri: str | None = Field(
        default=None, description="MLflow tracking server, http(s)://host:port; unset disables MLflow."
    )
    mlflow_experiment: str = Field(
        default=DEFAULT_EXPERIMENT, min_length=1, description="Experiment of the eval run (without mlflow_run_id)."
    )
    mlflow_run_id: str | None = Field(
        default=None,
        description="The training run's MLflow run id; unset: a run `<run>-eval` of its own, tagged pinned_eval.run.",
    )
    mlflow_username: str | None = Field(default=None, description="MLflow basic-auth user (with mlflow_password).")
    mlflow_password: SecretStr | None = Field(default=None, description="MLflow basic-auth password.")
    mlflow_token: SecretStr | None = Field(default=None, description="MLflow bearer token.")
    mlflow_samples_per_dataset: int = Field(
        default=0, ge=0, le=1000, description="Samples per dataset in the point's MLflow table artifact."
    )
    tensorboard: bool = Field(
        default=False, description="TensorBoard scalars in <results_root>/<run>/tensorboard (or tensorboard_dir)."
    )
    tensorboard_dir: str | None = Field(
        default=None, description="The trainer's TensorBoard log directory; points write into its `eval` subdirectory."
    )

    # prefect-aws S3Bucket instead of results_root / results_endpoint_url (blocks._aws)
    results_s3_bucket_block: str | None = Field(
        default=None, min_length=1,
        description="Name of a saved prefect-aws `S3Bucket` block whose bucket and folder are the results root "
                    "(instead of `results_root`; needs `pinned-eval[aws]`).",
    )
    _results_s3: tuple[str, dict[str, Any]] | None = PrivateAttr(default=None)  # resolved; holds secrets

    @model_validator(mode="after")
    def _one_results_root(self) -> SinksBlock:
        if self.results_s3_bucket_block is not None:
            for name in ("results_root", "results_endpoint_url"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: set either {name} or results_s3_bucket_block, not both")
            require_prefect_aws("results_s3_bucket_block")
        return self

    def results_store(self) -> ResultsStore | None:
        """The results store, or None when neither `results_root` nor `results_s3_bucket_block` is set."""
        if self.results_s3_bucket_block:
            if self._results_s3 is None:
                self._results_s3 = resolve_s3_bucket(self.results_s3_bucket_block, "results_s3_bucket_block")
            url, opts = self._results_s3
            return ResultsStore(url, dict(opts))
        if not self.results_root:
            return None
        remote = self.results_root.startswith(("s3://", "s3a://"))
        return ResultsStore(self.results_root, s3_storage_options(self.results_endpoint_url) if remote else None)

    @model_validator(mode="after")
    def _trackers(self) -> SinksBlock:
        """MLflow and TensorBoard: their extra installed, a place to write, credentials in pairs."""
        if self.mlflow_tracking_uri:
            if not self.mlflow_tracking_uri.startswith(("http://", "https://")):
                raise ValueError(f"mlflow_tracking_uri: {self.mlflow_tracking_uri!r:.80} is not an http(s):// URL "
                                 "of an MLflow tracking server")
            if (missing := missing_extra("mlflow", "mlflow")) is not None:
                raise ValueError(f"mlflow_tracking_uri: {missing}")
        if (self.mlflow_username is None) != (self.mlflow_password is None):
            raise ValueError("mlflow_username: basic auth needs both mlflow_username and mlflow_password")
        if self.tensorboard or self.tensorboard_dir:
            if (missing := missing_extra("tensorboard", "tensorboard")) is not None:
                raise ValueError(f"{'tensorboard_dir' if self.tensorboard_dir else 'tensorboard'}: {missing}")
            if self.tensorboard_dir is not None and not os.path.isabs(self.tensorboard_dir):
                raise ValueError(f"tensorboard_dir: {self.tensorboard_dir!r:.80} is not an absolute local directory")
            local_root = self.results_root and not self.results_root.startswith(("s3://", "s3a://"))
            if not self.tensorboard_dir and not local_root:
                raise ValueError("tensorboard: needs tensorboard_dir (the trainer's log directory) or a local "
                                 "results_root to write <results_root>/<run>/tensorboard")
        return self

    @model_validator(mode="after")
    def _shared_is_online(self) -> SinksBlock:
        if self.wandb_writer == "shared" and self.wandb_mode != "online":
            raise ValueError(f"wandb_writer: 'shared' writes into a live run and needs wandb_mode='online', "
                             f"got {self.wandb_mode!r}")
        return self
