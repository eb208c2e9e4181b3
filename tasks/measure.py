"""Measure a point's weights: the posture chooses the function from `MEASURES`.

Each measure function gets the point's blocks (`PointConfig`) and its `MeasureInput`, and returns
`Measured`: metrics per dataset of weight version `str(step)`, and the point's samples for the
exporters (None when the posture publishes its own).
- fleet: [fleet lock: pin the fleet to the snapshot → generate] → score;
- shared: [fleet lock: verify the live engines serve `str(step)` → generate] → score;
- external: [backend lock: the backend's `evaluate_checkpoint`] (it publishes its samples).
A suite with `eval.delegate` entries (fleet and shared postures) runs them under the same fleet
lock after generation (`tasks.delegate`; also when the generations came from the cache, or when
no dataset is due at the step: then the fleet is pinned for them alone); their `eval/...`
metrics are `Measured.delegated`, point-level metrics on every dataset row (with no dataset, on
the point's one row). A delegate metric named like one of pinned-eval's own
(`eval/<dataset>...` of this point, `eval/step`, ...) is the skip `delegate_failed`, never an
overwrite. The external posture refuses a suite with delegates (they need the fleet).
With a results store (fleet posture), generations stored under this point's cache key are reused
— no pin, no request — and only scored; fresh ones are stored before scoring
(`pinned_eval.results.cache.generation_key`, keyed by the snapshot's digest). Chat templates come
from the pinned snapshot's tokenizer (a LoRA adapter: its base's); shared: the engines' model.
An adapter-mode snapshot is named `str(step)` everywhere (its LoRA name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

from blocks import EvalSuiteBlock, ExternalBackendBlock, FleetBlock, SinksBlock, StagingBlock
from pinned_eval.datasets.loader import EvalSample
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.points import Posture
from pinned_eval.results.cache import generation_key, snapshot_digest
from pinned_eval.sinks import PointSamples
from pinned_eval.skips import EvalSkipped, SkipReason
from tasks.admission import pin_lock
from tasks.delegate import delegate
from tasks.external import backend_lock_name, evaluate_external
from tasks.generate import generate
from tasks.pin import pin_fleet, verify_shared
from tasks.results import cached_generations, store_generations
from tasks.score import score
from tasks.snapshots import Snapshot


class PointConfig(BaseModel):
    """The blocks a point uses, loaded once at flow start (sinks and staging first, so a failure
    loading the others is still recorded and the snapshot still retired)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    suite: EvalSuiteBlock
    fleet: FleetBlock
    staging: StagingBlock
    sinks: SinksBlock
    backend: ExternalBackendBlock | None = None  # the external posture's, named by `backend_block`


class MeasureInput(NamedTuple):
    run: str
    step: int
    snapshot: Snapshot | None  # None in the shared posture (the engines serve their own weights)
    datasets: list[ResolvedDataset]
    rows: dict[str, list[EvalSample]]


class Measured(NamedTuple):
    per_dataset: dict[str, dict[str, float]]
    samples: PointSamples | None
    delegated: dict[str, float] | None = None  # eval.delegate metrics (point-level)


# point-level keys pinned-eval writes itself (tasks.outcome); a delegate may not name one
OWN_POINT_KEYS = ("eval/step", "eval/lag_steps", "eval/duration_seconds", "eval/export_time_seconds",
                  "eval/datasets_run", "eval/datasets_not_due")


MeasureFn = Callable[[PointConfig, MeasureInput], Measured]


def measure_external(cfg: PointConfig, point: MeasureInput) -> Measured:
    if point.snapshot is None or cfg.backend is None:  # PointRequest: external needs a source and backend_block
        raise ValueError("external posture: needs a snapshot and backend_block")
    if cfg.suite.suite.delegates:
        raise ValueError("eval.delegate: the external posture hands the checkpoint to a backend; delegates "
                         "need the fleet (use the fleet or shared posture)")
    backend, options = cfg.backend.configuration()
    with pin_lock(backend_lock_name(backend, options)):
        metrics = evaluate_external(
            backend, str(point.snapshot.local_path), point.run, point.step, cfg.suite.suite, options
        )
    return Measured(metrics, None)


def _pin(cfg: PointConfig, point: MeasureInput) -> None:
    if point.snapshot is None:
        raise ValueError("fleet posture: needs a snapshot")
    pin_fleet(cfg.fleet, str(point.snapshot.local_path), str(point.step), point.snapshot.lora_base)


def _verify(cfg: PointConfig, point: MeasureInput) -> None:
    verify_shared(cfg.fleet, str(point.step))


def _generate_and_score(
    cfg: PointConfig, point: MeasureInput, prepare: Callable[[PointConfig, MeasureInput], None], cache: bool
) -> Measured:
    run, step, snapshot, datasets, rows = point
    version = str(step)
    lora = version if snapshot is not None and snapshot.adapter else None
    tokenizer_dir = cfg.fleet.model_path if snapshot is None else snapshot.lora_base or str(snapshot.local_path)
    results = cfg.sinks.results_store()
    key = None
    if cache and results is not None and snapshot is not None and datasets:
        key = generation_key(
            snapshot_digest(str(snapshot.local_path)), version, datasets, rows, tokenizer_dir, snapshot.lora_base
        )
    generations = cached_generations(results, run, step, key) if results is not None and key else None
    generations = [] if not datasets else generations  # delegates alone (no dataset due): nothing to generate
    delegates = cfg.suite.suite.delegates
    delegated: dict[str, float] = {}
    if generations is None or delegates:
        fresh = generations is None
        try:
            with pin_lock(cfg.fleet.lock_name):
                prepare(cfg, point)
                if generations is None:
                    generations = generate(
                        cfg.fleet,
                        datasets,
                        rows,
                        version,
                        rid_prefix=f"{run}-{step}",
                        tokenizer_dir=tokenizer_dir,
                        lora_path=lora,
                    )
                if delegates:
                    spent = sum(g.usage.requests if g.usage else 1 for g in generations) if fresh else 0
                    delegated = delegate(cfg.fleet, cfg.suite.suite, run, step, version, f"{run}-{step}", results,
                                         lora, spent)
        finally:  # generations made are kept for a rerun, also when a delegate then fails
            if fresh and generations is not None and results is not None and key:
                store_generations(results, run, step, key, generations)
    assert generations is not None
    per_dataset, samples = score(generations, datasets, cfg.suite.suite, step, key)
    _no_collision(delegated, per_dataset, [d.name for d in cfg.suite.suite.delegates])
    return Measured(per_dataset, samples, delegated)


def _no_collision(delegated: dict[str, float], per_dataset: dict[str, dict[str, float]], names: list[str]) -> None:
    """A delegate metric named like one of pinned-eval's own is `delegate_failed` (no overwrite)."""
    own = {k for m in per_dataset.values() for k in m} | set(OWN_POINT_KEYS)
    clash = sorted(k for k in delegated if k in own or k.startswith(("eval/skipped_", "eval/sink_failed_")))
    if clash:
        raise EvalSkipped(SkipReason.DELEGATE_FAILED,
                          f"delegates {names}: metric {clash[0]!r} is one of pinned-eval's own for this point")


def measure_fleet(cfg: PointConfig, point: MeasureInput) -> Measured:
    return _generate_and_score(cfg, point, _pin, cache=True)


def measure_shared(cfg: PointConfig, point: MeasureInput) -> Measured:
    return _generate_and_score(cfg, point, _verify, cache=False)


MEASURES: dict[Posture, MeasureFn] = {
    Posture.FLEET: measure_fleet,
    Posture.SHARED: measure_shared,
    Posture.EXTERNAL: measure_external,
}
