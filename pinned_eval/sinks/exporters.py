"""The exporter seam: the `Exporter` protocol, the `EXPORTERS` registry and `export_all`.

The contract is stated in the package docstring (`pinned_eval.sinks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, SecretStr
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from pinned_eval.external import DatasetResult
from pinned_eval.sinks.ledger import MetricRow

if TYPE_CHECKING:  # pyarrow: the trainer side reads the ledger without it
    from pinned_eval.results.store import ResultsStore

SINK_ATTEMPTS = 3  # per exporter; waits 0.5 s, 1 s between attempts
SINK_FAILED = "eval/sink_failed_"  # + exporter name: 1.0 on the ledger rows of a point it failed


class PointSamples(BaseModel):
    """A measured point's per-sample results, for the exporters that publish them.

    `results`: per dataset, what the samples artifact holds; `rows`: the samples file's rows
    (`pinned_eval.results.tables.samples_table`: generation rows with `reward`); `key`: the
    generation cache key they were made under."""

    model_config = ConfigDict(frozen=True)

    results: dict[str, DatasetResult]
    rows: list[dict[str, Any]]
    key: str | None = None


@dataclass(frozen=True)
class PointRecord:
    """What every exporter gets: the point's ledger rows and, when measured, its samples."""

    run: str
    step: int
    rows: list[MetricRow]
    flow_run_id: str | None = None
    samples: PointSamples | None = None

    @property
    def measured(self) -> bool:
        return self.rows[0].state == "measured"


class SinkSettings(Protocol):
    """The sinks block's fields an exporter factory reads (`blocks.sinks.SinksBlock`)."""

    @property
    def jsonl_path(self) -> str | None: ...
    @property
    def wandb_project(self) -> str | None: ...
    @property
    def wandb_entity(self) -> str | None: ...
    @property
    def wandb_run_id(self) -> str | None: ...
    @property
    def wandb_writer(self) -> str: ...
    @property
    def wandb_mode(self) -> str: ...
    @property
    def wandb_dir(self) -> str | None: ...
    @property
    def wandb_samples_per_dataset(self) -> int: ...
    @property
    def results_root(self) -> str | None: ...
    # MLflow and TensorBoard (`sinks.mlflow`, `sinks.tensorboard`)
    @property
    def mlflow_tracking_uri(self) -> str | None: ...
    @property
    def mlflow_experiment(self) -> str: ...
    @property
    def mlflow_run_id(self) -> str | None: ...
    @property
    def mlflow_username(self) -> str | None: ...
    @property
    def mlflow_password(self) -> SecretStr | None: ...
    @property
    def mlflow_token(self) -> SecretStr | None: ...
    @property
    def mlflow_samples_per_dataset(self) -> int: ...
    @property
    def tensorboard(self) -> bool: ...
    @property
    def tensorboard_dir(self) -> str | None: ...
    def results_store(self) -> ResultsStore | None: ...


class Parcel(BaseModel):
    """All a deferrable exporter's `send` needs for one point, as JSON: made on the point
    (`Exporter.parcel`: cheap, local reads only), sent now or later by another process.

    `config`: the exporter's own settings, rebuilt with its registration's `restore` (secrets in
    plain text: a parcel is kept only in memory or in the worker's private outbox,
    `pinned_eval.sinks.outbox`); `lock`: the `exclusive` lock name for this point; `body`: the
    point's data as the exporter sends it (metrics, step, sample tables)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    exporter: str
    config: dict[str, Any]
    lock: str | None = None
    body: dict[str, Any]


@runtime_checkable
class Exporter(Protocol):
    """A best-effort mirror of the ledger. `export` raises on failure (retried by `export_all`);
    `exclusive` names the lock to hold around each attempt (None: none); `describe_failure` turns
    the last error into the text noted in the ledger; `close` is called once after the point.

    A `deferrable` exporter (a remote tracker: W&B, MLflow) splits `export` into `parcel` (on the
    point) and `send` (anywhere: `export(r)` is `send(parcel(r))`), so a worker's deliverer can do
    the sending off the point's path (`pinned_eval.sinks.outbox`)."""

    name: str
    deferrable: bool

    def exclusive(self, record: PointRecord) -> str | None: ...
    def export(self, record: PointRecord) -> None: ...
    def parcel(self, record: PointRecord) -> Parcel: ...
    def send(self, parcel: Parcel) -> None: ...
    def describe_failure(self, error: str) -> str: ...
    def close(self) -> None: ...


class BaseExporter:
    """Defaults for the optional parts of `Exporter`: no lock, the error as is, nothing to close,
    not deferrable (`parcel`/`send` raise)."""

    name: str = ""
    deferrable: bool = False

    def exclusive(self, record: PointRecord) -> str | None:
        return None

    def export(self, record: PointRecord) -> None:
        if not self.deferrable:
            raise NotImplementedError
        self.send(self.parcel(record))

    def parcel(self, record: PointRecord) -> Parcel:
        raise NotImplementedError(f"exporter {self.name!r} is not deferrable")

    def send(self, parcel: Parcel) -> None:
        raise NotImplementedError(f"exporter {self.name!r} is not deferrable")

    def describe_failure(self, error: str) -> str:
        return error

    def close(self) -> None:
        return None


ExporterFactory = Callable[[SinkSettings], Exporter | None]
ExporterRestore = Callable[[dict[str, Any]], Exporter]  # a deferrable exporter from its `Parcel.config`


@dataclass(frozen=True)
class Registration:
    name: str
    build: ExporterFactory
    order: int = field(default=50)
    restore: ExporterRestore | None = None


EXPORTERS: dict[str, Registration] = {}


def register_exporter(
    name: str, build: ExporterFactory, *, order: int = 50, restore: ExporterRestore | None = None
) -> None:
    """Register exporter `name` (built per point by `build`, run in ascending `order`; a
    deferrable one also rebuilt from its parcel's config by `restore`)."""
    if name in EXPORTERS:
        raise ValueError(f"exporter {name!r} is already registered ({EXPORTERS[name].build!r})")
    EXPORTERS[name] = Registration(name, build, order, restore)


def restore_exporter(parcel: Parcel) -> Exporter:
    """The exporter that sends `parcel` (`ValueError` naming it when none can)."""
    reg = EXPORTERS.get(parcel.exporter)
    if reg is None or reg.restore is None:
        raise ValueError(f"no deferrable exporter {parcel.exporter!r} is registered")
    return reg.restore(parcel.config)


def plain_config(config: BaseModel) -> dict[str, Any]:
    """`config` as JSON-able values with its secrets revealed (for `Parcel.config`)."""
    return {k: v.get_secret_value() if isinstance(v, SecretStr) else v
            for k, v in config.model_dump(mode="python").items()}


def build_exporters(settings: SinkSettings) -> list[Exporter]:
    """The configured exporters for `settings`, in their registered order."""
    built = (reg.build(settings) for reg in sorted(EXPORTERS.values(), key=lambda r: (r.order, r.name)))
    return [exporter for exporter in built if exporter is not None]


def attempt_sink(write: Callable[[], None]) -> str | None:
    """Run `write` up to `SINK_ATTEMPTS` times: None once it succeeds, else its last error."""
    retrying = Retrying(
        stop=stop_after_attempt(SINK_ATTEMPTS),
        wait=wait_exponential(multiplier=0.5, max=4.0),
        retry=retry_if_exception_type(Exception),
        reraise=True,
    )
    try:
        for attempt in retrying:
            with attempt:
                write()
    except Exception as exc:  # recorded beside the point (ledger, log, state message), never dropped
        return f"{type(exc).__name__}: {exc}"
    return None


Hold = Callable[[str], AbstractContextManager[Any]]


def export_all(exporters: Sequence[Exporter], record: PointRecord, hold: Hold | None = None) -> dict[str, str]:
    """Export `record` to each exporter in turn (each retried, each isolated from the others);
    returns {name: error as the ledger notes it} for those that failed after their attempts."""
    errors: dict[str, str] = {}
    for exporter in exporters:
        lock = exporter.exclusive(record)

        def once(exporter: Exporter = exporter, lock: str | None = lock) -> None:
            if lock is not None and hold is not None:
                with hold(lock):
                    exporter.export(record)
            else:
                exporter.export(record)

        error = attempt_sink(once)
        if error is not None:
            errors[exporter.name] = exporter.describe_failure(error)
    return errors


def close_all(exporters: Iterable[Exporter]) -> None:
    for exporter in exporters:
        exporter.close()


def with_sink_errors(row: MetricRow, errors: dict[str, str]) -> MetricRow:
    """`row` noting the failed exporters: `sink_errors` and `eval/sink_failed_<name>: 1`."""
    failed = {f"{SINK_FAILED}{name}": 1.0 for name in errors}
    return row.model_copy(update={"sink_errors": {**row.sink_errors, **errors}, "metrics": {**row.metrics, **failed}})
