"""External-posture task: a `CheckpointEvalFn` backend replaces pin + generate + score.

Contract of `evaluate_external`:
- the backend class is loaded by dotted path (`module:Class` or `module.Class`) and constructed
  with `options` (keyword arguments) once per process and configuration: `BACKENDS` keeps one
  instance per (path, options) and reuses it for every later point of that process; the caller
  holds `backend_lock_name(path, options)` (limit 1, as fleet points hold `fleet-<name>`) around
  the call, so two points never pin one backend to different versions at once;
- awaits `evaluate_checkpoint(checkpoint_dir, EvalInput)` and returns pinned-eval metrics per
  dataset (the shape `tasks/score.py::score` returns);
- a backend's `EvalSkip(reason)` becomes `EvalSkipped(reason)` (→ `eval/skipped_<reason>`) and
  the instance stays cached; any other exception (a crash, the point's deadline) propagates and
  the instance is disposed and dropped, so the next point builds a fresh one;
- `dispose()` runs exactly once per instance: when it is dropped, or at interpreter exit (atexit)
  for every cached one; a dispose error is logged, never masking the point's outcome;
- a measured point publishes its per-sample results as the table artifact
  `samples_artifact_key(run, step)` (rows from `pinned_eval.external.sample_rows`), which
  the miles adapter reads back. `record_point_samples` is usable by any posture.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import logging
import re
import threading
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from pinned_eval.external import (
    CheckpointEvalFn,
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


def backend_key(backend: str, options: dict[str, Any] | None) -> str:
    """A backend configuration's identity: its class path and options (JSON, sorted keys)."""
    try:
        return json.dumps({"backend": backend, "options": options or {}}, sort_keys=True)
    except TypeError as exc:
        raise ValueError(f"backend_options: must be JSON values (they are flow parameters): {exc}") from exc


def backend_lock_name(backend: str, options: dict[str, Any] | None) -> str:
    """`backend-<class>-<digest of the configuration>`: the global concurrency limit (size 1)
    external points of one backend configuration hold."""
    cls = re.split(r"[:.]", backend)[-1].lower()
    digest = hashlib.sha256(backend_key(backend, options).encode()).hexdigest()[:12]
    return f"backend-{cls}-{digest}"


class BackendCache:
    """This process's external backends, one instance per configuration (see module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, CheckpointEvalFn] = {}

    def get(self, backend: str, options: dict[str, Any] | None) -> CheckpointEvalFn:
        key = backend_key(backend, options)
        with self._lock:  # one construction per key, also for callers without the backend lock
            fn = self._entries.get(key)
            if fn is None:
                fn = self._entries[key] = load_backend(backend)(**(options or {}))
            return fn

    def drop(self, backend: str, options: dict[str, Any] | None) -> None:
        """Dispose and forget the instance of this configuration (if any)."""
        with self._lock:
            fn = self._entries.pop(backend_key(backend, options), None)
        if fn is not None:
            _dispose(fn)

    def dispose_all(self) -> None:
        """Dispose every cached instance (atexit); errors are logged, never raised at exit."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for fn in entries:
            _dispose(fn)

    def __len__(self) -> int:
        return len(self._entries)


BACKENDS = BackendCache()
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
    eval_input = EvalInput(run=run, step=step, hf_dir=checkpoint_dir, suite=suite)
    fn = BACKENDS.get(backend, options)
    try:
        results = asyncio.run(run_backend(fn, checkpoint_dir, eval_input))
        metrics = results_to_metrics(results, eval_input)
    except EvalSkipped as skip:  # the backend's EvalSkip: attributable, the instance stays usable
        raise EvalSkipped(skip.reason, skip.message) from skip
    except BaseException:  # a crash or the deadline: the instance's state is unknown, rebuild it
        BACKENDS.drop(backend, options)
        raise
    if record_samples:
        record_point_samples(run, step, results.data)
    return metrics


def _dispose(fn: CheckpointEvalFn) -> None:
    """Dispose an instance that is being dropped: its error is logged (the point's outcome, or the
    interpreter's exit, stands)."""
    try:
        fn.dispose()
    except Exception:
        logging.getLogger(__name__).exception("dispose() of %s failed", type(fn).__name__)
