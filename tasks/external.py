"""External-posture task: a `CheckpointEvalFn` backend replaces pin + generate + score.

Contract of `evaluate_external`:
- loads the backend class by dotted path (`module:Class` or `module.Class`), constructs it with
  `options` (keyword arguments), awaits `evaluate_checkpoint(checkpoint_dir, EvalInput)`, and
  returns pinned-eval metrics per dataset (the shape `tasks/score.py::score` returns);
- `dispose()` runs exactly once in `finally` once the backend was constructed; a dispose error
  is raised when the eval succeeded and logged (never masking it) when the eval already failed;
- a backend's `EvalSkip(reason)` becomes `EvalSkipped(reason)` (→ `eval/skipped_<reason>`), any
  other exception propagates (→ crashed);
- a measured point publishes its per-sample results as the table artifact
  `samples_artifact_key(run, step)` (rows from `pinned_eval.external.sample_rows`), which
  the miles adapter reads back. `record_point_samples` is usable by any posture.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from pinned_eval.external import (
    DatasetResult,
    EvalInput,
    load_backend,
    results_to_metrics,
    run_backend,
    sample_rows,
    samples_artifact_key,
)
from pinned_eval.skips import EvalSkipped
from pinned_eval.suite import EvalSuite


def record_point_samples(run: str, step: int, data: dict[str, DatasetResult]) -> None:
    """Publish a point's per-sample results (call inside a flow or task run)."""
    create_table_artifact(
        table=sample_rows(data),
        key=samples_artifact_key(run, step),
        description=f"per-sample results of eval point {run}/step-{step}",
    )


@task(cache_policy=NO_CACHE, task_run_name="external-eval-{step}")
def evaluate_external(
    backend: str,
    checkpoint_dir: str,
    run: str,
    step: int,
    suite: EvalSuite,
    options: dict[str, Any] | None = None,
    record_samples: bool = True,
) -> dict[str, dict[str, float]]:
    """Measure `checkpoint_dir` as weight version `str(step)` with the external backend."""
    eval_input = EvalInput(run=run, step=step, hf_dir=checkpoint_dir, suite=suite)
    fn = load_backend(backend)(**(options or {}))
    try:
        results = asyncio.run(run_backend(fn, checkpoint_dir, eval_input))
        metrics = results_to_metrics(results, eval_input)
    except EvalSkipped as skip:  # the backend's EvalSkip, or a fleet skip it let through
        raise EvalSkipped(skip.reason, skip.message) from skip
    finally:
        _dispose(fn, failing=sys.exc_info()[1] is not None)
    if record_samples:
        record_point_samples(run, step, results.data)
    return metrics


def _dispose(fn: Any, *, failing: bool) -> None:
    try:
        fn.dispose()
    except Exception:
        if not failing:
            raise
        get_run_logger().exception("dispose() of %s failed after the eval failed", type(fn).__name__)
