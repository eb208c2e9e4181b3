"""External backends kept for reuse: one `CheckpointEvalFn` instance per configuration per process.

A configuration is a backend's class path and its constructor options (`backend_key`). Contract
of `BackendCache` (the process's cache is `tasks.external.BACKENDS`, or the backend host's own,
`pinned_eval.backend_host`):
- `get` constructs an instance on first use of its configuration and returns the same instance
  afterwards (one construction per configuration, also under concurrent callers);
- `evaluate` measures one checkpoint with the cached instance: a backend's `EvalSkip` (any
  `EvalSkipped`) propagates and the instance stays cached; any other exception (a crash, the
  point's deadline, a cancellation) disposes and drops the instance, so the next point builds a
  fresh one, and propagates;
- `dispose()` runs exactly once per instance: when it is dropped, or by `dispose_all` (at process
  exit or the host's shutdown); a dispose error is logged, never masking the point's outcome.

Callers hold `backend_lock_name(...)` (a global concurrency limit of 1, as fleet points hold
`fleet-<name>`) around `evaluate`, so two points never pin one backend to different versions at once.
A synchronous `evaluate_checkpoint` cannot be interrupted: a caller whose point was abandoned keeps
its lock until the call returns, then drops the instance (`pinned_eval.backend_host`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

from pinned_eval.external import CheckpointEvalFn, EvalInput, EvalResults, load_backend, run_backend
from pinned_eval.skips import EvalSkipped

log = logging.getLogger(__name__)


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


@dataclass
class CachedBackend:
    """One cached instance and how much it has served (reported by the backend host)."""

    backend: str
    options: dict[str, Any]
    fn: CheckpointEvalFn
    evaluations: int = 0


class BackendCache:
    """A process's external backends, one instance per configuration (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, CachedBackend] = {}

    def get(self, backend: str, options: dict[str, Any] | None) -> CheckpointEvalFn:
        key = backend_key(backend, options)
        with self._lock:  # one construction per key, also for callers without the backend lock
            entry = self._entries.get(key)
            if entry is None:
                fn = load_backend(backend)(**(options or {}))
                entry = self._entries[key] = CachedBackend(backend, dict(options or {}), fn)
            return entry.fn

    async def evaluate(
        self, backend: str, options: dict[str, Any] | None, checkpoint_dir: str, eval_input: EvalInput
    ) -> EvalResults:
        """Measure `checkpoint_dir` with the cached instance (construct it first if needed).

        Construction runs here, on the caller's thread: a host that must stay responsive calls
        `get` in a worker thread first."""
        fn = self.get(backend, options)
        try:
            results = await run_backend(fn, checkpoint_dir, eval_input)
        except EvalSkipped:  # attributable: the instance stays usable
            raise
        except BaseException:  # a crash, the deadline, a cancellation: the instance's state is unknown
            await asyncio.to_thread(self.drop, backend, options)  # dispose() may block: off the event loop
            raise
        with self._lock:
            if (entry := self._entries.get(backend_key(backend, options))) is not None:
                entry.evaluations += 1
        return results

    def drop(self, backend: str, options: dict[str, Any] | None) -> None:
        """Dispose and forget the instance of this configuration (if any)."""
        with self._lock:
            entry = self._entries.pop(backend_key(backend, options), None)
        if entry is not None:
            _dispose(entry.fn)

    def dispose_all(self) -> None:
        """Dispose every cached instance; errors are logged, never raised (this runs at exit)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            _dispose(entry.fn)

    def entries(self) -> list[CachedBackend]:
        """A snapshot of the cached instances."""
        with self._lock:
            return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


def _dispose(fn: CheckpointEvalFn) -> None:
    """Dispose an instance that is being dropped: its error is logged (the point's outcome, or the
    process's exit, stands)."""
    try:
        fn.dispose()
    except Exception:
        log.exception("dispose() of %s failed", type(fn).__name__)
