"""The external posture's contract: a black box takes a checkpoint directory and returns results.

`CheckpointEvalFn` (miles' contract, DESIGN §5):
- constructed with keyword options only (JSON-able values: they travel as flow parameters); the
  constructor prepares the backend (launch, attach, client) and cleans up after itself if it fails;
- `async evaluate_checkpoint(checkpoint_dir, input) -> EvalResults` measures the weights in
  `checkpoint_dir` as `input.weight_version` (= str(step)). Async, as in miles; a plain `def` that
  returns `EvalResults` is accepted too (`run_backend` awaits only awaitables);
- one instance serves every point of its process with that configuration, one point at a time
  (the flow holds the configuration's lock), so `evaluate_checkpoint` re-pins per call;
- `dispose()` tears down what the constructor launched, and only that; it is called exactly once:
  after a crash of one of its evals (the next point builds a new instance) or at process exit;
- `raise EvalSkip(reason)` for an attributable non-result: the point records
  `eval/skipped_<reason>: 1` (a lowercase slug, e.g. "quota"); any other exception is a crash.

`EvalResults.data[ds]` holds one entry per generated sample, in prompt-major order (prompt p,
replica j at position p*n + j, n = the dataset's `n_samples_per_prompt`): rewards (None = no
reward), truncated flags, the weight version that generated each sample, and response lengths in
tokens. `results_to_metrics` turns it into pinned-eval's DESIGN §6 metrics with `dataset_metrics`.

Per-sample records (`sample_rows` / `results_from_rows`) are the wire format in which a point
publishes its per-sample results (a table artifact keyed `samples_artifact_key(run, step)`), read
back by the miles adapter. This module imports no Prefect.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.plugins import load_object
from pinned_eval.points import RunName, history_artifact_key, weight_version
from pinned_eval.scoring.metrics import ScoredSample, dataset_metrics
from pinned_eval.skips import EvalSkipped
from pinned_eval.suite import EvalSuite

__all__ = [
    "CheckpointEvalFn",
    "DatasetResult",
    "EvalInput",
    "EvalResults",
    "EvalSkip",
    "SampleRow",
    "load_backend",
    "results_from_rows",
    "results_to_metrics",
    "run_backend",
    "sample_rows",
    "samples_artifact_key",
]


class EvalSkip(EvalSkipped):
    """Raised by a backend for an attributable skip: logged as `eval/skipped_<reason>`."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(reason, message)

    def __reduce__(self) -> tuple[Any, ...]:  # keep (reason, message) across pickling
        return (type(self), (self.reason, self.message))


class EvalInput(BaseModel):
    """What a backend is told about the point it measures."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: RunName = Field(description="Training run name.")
    step: int = Field(ge=0, description="Training step whose weights are measured.")
    hf_dir: str = Field(min_length=1, description="The checkpoint directory (HF format).")
    suite: EvalSuite = Field(description="Datasets, sampling and rewards to measure.")

    @model_validator(mode="before")
    @classmethod
    def _derived_weight_version(cls, data: Any) -> Any:
        """`weight_version` is derived from `step`, so a dump validates back; another value is refused."""
        if isinstance(data, dict) and "weight_version" in data:
            data = dict(data)
            given = data.pop("weight_version")
            if given != str(data.get("step")):
                raise ValueError(f"weight_version: {given!r} is not str(step) for step {data.get('step')!r}")
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def weight_version(self) -> str:
        return weight_version(self.step)

    @property
    def datasets(self) -> list[ResolvedDataset]:
        return self.suite.resolved()


class DatasetResult(BaseModel):
    """Per-sample results of one dataset, prompt-major (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rewards: list[float | None]
    truncated: list[bool]
    weight_versions: list[str | None]
    response_lens: list[int]

    @model_validator(mode="after")
    def _same_lengths(self) -> DatasetResult:
        sizes = {k: len(getattr(self, k)) for k in ("rewards", "truncated", "weight_versions", "response_lens")}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"per-sample lists differ in length: {sizes}")
        if any(n < 0 for n in self.response_lens):
            raise ValueError("response_lens: lengths must be >= 0")
        return self

    def __len__(self) -> int:
        return len(self.rewards)

    @classmethod
    def from_scored(cls, samples: list[ScoredSample]) -> DatasetResult:
        """From scored samples in any order (sorted prompt-major here)."""
        ordered = sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))
        return cls(
            rewards=[s.reward for s in ordered],
            truncated=[s.truncated for s in ordered],
            weight_versions=[s.weight_version for s in ordered],
            response_lens=[s.response_len for s in ordered],
        )

    def to_miles(self) -> dict[str, list[Any]]:
        """miles' `RolloutFnEvalOutput.data[ds]` shape (plus pinned-eval's extra lists)."""
        return self.model_dump()


class EvalResults(BaseModel):
    """What `evaluate_checkpoint` returns: per-dataset samples, plus optional extra metrics."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data: dict[str, DatasetResult]
    metrics: dict[str, float] = Field(
        default_factory=dict, description="Extra `eval/...` metrics, logged with every dataset's row."
    )


class CheckpointEvalFn(abc.ABC):
    """A black-box checkpoint evaluator (see the module docstring for the contract)."""

    @abc.abstractmethod
    async def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:
        """Measure the weights in `checkpoint_dir` on `input.suite` as `input.weight_version`."""

    def dispose(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Tear down whatever the constructor launched (and nothing else)."""


def load_backend(path: str) -> type[CheckpointEvalFn]:
    """Import a backend class from `module:Class` or `module.Class` (`pinned_eval.plugins`: a
    malformed path, a module that does not import or a missing class is a `PluginError`, an
    object that is no `CheckpointEvalFn` subclass a `PluginTypeError`, a `TypeError`)."""
    cls: type[CheckpointEvalFn] = load_object(path, expect=CheckpointEvalFn, what="backend")
    return cls


async def run_backend(fn: CheckpointEvalFn, checkpoint_dir: str, input: EvalInput) -> EvalResults:
    """Call `evaluate_checkpoint` (async or sync) and validate what it returned."""
    out: Any = fn.evaluate_checkpoint(checkpoint_dir, input)
    if inspect.isawaitable(out):
        out = await out
    if isinstance(out, EvalResults):
        return out
    if isinstance(out, dict):
        return EvalResults.model_validate(out)
    raise TypeError(f"{type(fn).__name__}.evaluate_checkpoint returned {type(out).__name__}, not EvalResults")


def results_to_metrics(results: EvalResults, input: EvalInput) -> dict[str, dict[str, float]]:
    """pinned-eval metrics per dataset (the shape `tasks/score.py::score` returns)."""
    datasets = {ds.name: ds for ds in input.datasets}
    missing, unexpected = sorted(datasets.keys() - results.data.keys()), sorted(results.data.keys() - datasets.keys())
    if missing or unexpected:
        raise ValueError(f"results.data: missing datasets {missing}, unexpected datasets {unexpected}")
    bad = sorted(k for k in results.metrics if not k.startswith("eval/"))
    if bad:
        raise ValueError(f"results.metrics: keys must start with 'eval/', got {bad}")
    out: dict[str, dict[str, float]] = {}
    for name, ds in datasets.items():
        res, n = results.data[name], ds.n_samples_per_prompt
        if len(res) % n:
            raise ValueError(f"results.data[{name!r}]: {len(res)} samples is not a multiple of n={n}")
        scored = [
            ScoredSample(
                prompt_index=i // n,
                sample_index=i % n,
                response="",
                response_len=res.response_lens[i],
                reward=res.rewards[i],
                truncated=res.truncated[i],
                weight_version=res.weight_versions[i],
            )
            for i in range(len(res))
        ]
        metrics = dataset_metrics(
            name,
            scored,
            pass_at_k=input.suite.pass_at_k and n > 1,
            pass_threshold=input.suite.pass_threshold,
            expected_version=input.weight_version,
        )
        clash = sorted(metrics.keys() & results.metrics.keys())
        if clash:
            raise ValueError(f"results.metrics: {clash} are computed by pinned-eval, not the backend")
        out[name] = {**metrics, **results.metrics}
    return out


# ---------------------------------------------------------------------------- per-sample records


class SampleRow(BaseModel):
    """One sample of a point's per-sample record (one row of the samples table)."""

    model_config = ConfigDict(extra="forbid")

    dataset: str
    index: int = Field(ge=0, description="Position in the dataset's prompt-major list.")
    reward: float | None
    truncated: bool
    weight_version: str | None
    response_len: int = Field(ge=0)


def samples_artifact_key(run: str, step: int) -> str:
    """Key of a point's per-sample table artifact (lowercase letters, digits, dashes)."""
    return f"{history_artifact_key(run)}-step-{step}-samples"


def sample_rows(data: dict[str, DatasetResult]) -> list[dict[str, Any]]:
    """Per-sample rows (JSON-able dicts) of every dataset, datasets in name order."""
    return [
        SampleRow(
            dataset=name,
            index=i,
            reward=res.rewards[i],
            truncated=res.truncated[i],
            weight_version=res.weight_versions[i],
            response_len=res.response_lens[i],
        ).model_dump()
        for name, res in sorted(data.items())
        for i in range(len(res))
    ]


def results_from_rows(rows: list[dict[str, Any]]) -> dict[str, DatasetResult]:
    """Inverse of `sample_rows`; every dataset's indices must be exactly 0..N-1."""
    by_ds: dict[str, list[SampleRow]] = {}
    for i, raw in enumerate(rows):
        try:
            row = SampleRow.model_validate(raw)
        except ValueError as exc:
            raise ValueError(f"samples row {i}: {exc}") from exc
        by_ds.setdefault(row.dataset, []).append(row)
    out = {}
    for name, ds_rows in by_ds.items():
        ds_rows.sort(key=lambda r: r.index)
        if [r.index for r in ds_rows] != list(range(len(ds_rows))):
            raise ValueError(f"samples of {name!r}: indices are not 0..{len(ds_rows) - 1}")
        out[name] = DatasetResult(
            rewards=[r.reward for r in ds_rows],
            truncated=[r.truncated for r in ds_rows],
            weight_versions=[r.weight_version for r in ds_rows],
            response_lens=[r.response_len for r in ds_rows],
        )
    return out
