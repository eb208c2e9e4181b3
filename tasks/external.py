"""External-posture task: a `CheckpointEvalFn` backend replaces pin + generate + score.

Contract of `evaluate_external`:
- `backend` and `options` come from a saved `ExternalBackendBlock` (`configuration()`: set by an
  operator, never from a point's parameters); the class is loaded by dotted path
  (`module:Class` or `module.Class`) and constructed with `options` (keyword arguments, secret ones
  included) once per configuration, then reused for every later point
  (`pinned_eval.backends.BackendCache`): in the backend host named by `HOST_ENV` when set (a
  deployed worker's flow runs: each is its own process, the host outlives them), else in this
  process (`BACKENDS`, disposed at interpreter exit);
- the caller holds `backend_lock_name(path, options)` (limit 1, as fleet points hold
  `fleet-<name>`) around the call, so two points never pin one backend to different versions at once;
- awaits `evaluate_checkpoint(checkpoint_dir, EvalInput)` and returns pinned-eval metrics per
  dataset (the shape `tasks/score.py::score` returns);
- a backend's `EvalSkip(reason)` becomes `EvalSkipped(reason)` (→ `eval/skipped_<reason>`) and
  the instance stays cached; any other exception (a crash, the point's deadline) propagates and
  the instance is disposed and dropped, so the next point builds a fresh one (in the host: a
  `BackendError` naming the backend's exception class);
- a measured point publishes its per-sample results as the table artifact
  `samples_artifact_key(run, step)` (`tasks.artifacts.record_point_samples`), which the miles
  adapter reads back.
"""

from __future__ import annotations

import asyncio
import atexit
import os
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from pinned_eval.backend_host import HOST_ENV, evaluate_hosted
from pinned_eval.backends import BackendCache, backend_key, backend_lock_name
from pinned_eval.external import (
    EvalInput,
    EvalResults,
    results_to_metrics,
)
from pinned_eval.skips import EvalSkipped
from pinned_eval.suite import EvalSuite
from tasks.artifacts import record_point_samples

__all__ = ["BACKENDS", "BackendCache", "backend_key", "backend_lock_name", "evaluate_external", "record_point_samples"]

BACKENDS = BackendCache()  # this process's backends, when no backend host is named
atexit.register(BACKENDS.dispose_all)


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
    """Measure `checkpoint_dir` as weight version `str(step)` with the (cached) external backend."""
    backend_key(backend, options)  # JSON-able options, named, before anything is built
    eval_input = EvalInput(run=run, step=step, hf_dir=checkpoint_dir, suite=suite)
    host = os.environ.get(HOST_ENV)
    results = (
        evaluate_hosted(host, backend, options, checkpoint_dir, eval_input)
        if host
        else _evaluate_here(backend, options, checkpoint_dir, eval_input)
    )
    metrics = results_to_metrics(results, eval_input)
    if record_samples:
        record_point_samples(run, step, results.data)
    return metrics


def _evaluate_here(
    backend: str, options: dict[str, Any] | None, checkpoint_dir: str, eval_input: EvalInput
) -> EvalResults:
    try:
        return asyncio.run(BACKENDS.evaluate(backend, options, checkpoint_dir, eval_input))
    except EvalSkipped as skip:  # the backend's EvalSkip: a plain skip for the flow's skip path
        raise EvalSkipped(skip.reason, skip.message) from skip
    except BaseException:  # the deadline lands wherever this thread is, maybe outside the coroutine
        BACKENDS.drop(backend, options)  # a no-op when the coroutine dropped it already
        raise
