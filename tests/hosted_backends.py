"""External backends for the backend-host tests: each writes its lifecycle to a JSONL file, since
it runs in another process (the host) than the test that checks it."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pinned_eval.external import CheckpointEvalFn, DatasetResult, EvalInput, EvalResults, EvalSkip
from pinned_eval.polling import poll_until
from pinned_eval.processes import ProcessSpec, start_process, stop_process


def read_lifecycle(path: str) -> list[dict[str, Any]]:
    """The recorded events, in order (an absent file: none yet)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _record(log: str, instance: object, event: str, version: str | None = None, **extra: object) -> None:
    line = {"event": event, "pid": os.getpid(), "instance": id(instance), "version": version, "t": time.time(), **extra}
    with open(log, "a") as f:
        f.write(json.dumps(line) + "\n")


class LifecycleBackend(CheckpointEvalFn):
    """Records init / pin / evaluated / cancelled / dispose with its PID and instance id.

    `mode`: "measure" (default), "quota" (EvalSkip), "boom" (a crash), "bad_init" (the constructor
    fails); `delay_s`: how long an evaluation takes (between its pin and evaluated events)."""

    def __init__(self, log: str, mode: str = "measure", delay_s: float = 0.0, tag: str = "") -> None:
        self.log, self.mode, self.delay_s = log, mode, delay_s
        if mode == "bad_init":
            raise ValueError("model_path: no such checkpoint")
        self._write("init")

    def _write(self, event: str, version: str | None = None) -> None:
        _record(self.log, self, event, version)

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:
        v = input.weight_version
        self._write("pin", v)
        try:
            await asyncio.sleep(self.delay_s)  # a second point interleaving here would re-pin this one
        except asyncio.CancelledError:
            self._write("cancelled", v)
            raise
        if self.mode == "quota":
            raise EvalSkip("quota", "no credits left")
        if self.mode == "boom":
            raise RuntimeError("engine died mid-eval")
        self._write("evaluated", v)
        return _results(input, v)

    def dispose(self) -> None:
        self._write("dispose")


def _results(input: EvalInput, version: str) -> EvalResults:
    return EvalResults(
        data={
            ds.name: DatasetResult(
                rewards=[1.0] * 6, truncated=[False] * 6, weight_versions=[version] * 6, response_lens=[1] * 6
            )
            for ds in input.datasets
        }
    )


class GatedSyncBackend(CheckpointEvalFn):
    """A synchronous backend (a blocking client library): `evaluate_checkpoint` records its pin,
    then blocks until the file `<gate>/release-<version>` exists, records `evaluated` and returns."""

    def __init__(self, log: str, gate: str) -> None:
        self.log, self.gate = log, gate
        _record(log, self, "init")

    def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:  # type: ignore[override]
        v = input.weight_version
        _record(self.log, self, "pin", v)
        release = os.path.join(self.gate, f"release-{v}")
        poll_until(lambda: os.path.exists(release), timeout_s=600, interval_s=0.05, what=release)
        _record(self.log, self, "evaluated", v)
        return _results(input, v)

    def dispose(self) -> None:
        _record(self.log, self, "dispose")


class ChildLaunchingBackend(CheckpointEvalFn):
    """Launches a long-running child process at construction, as a backend launches its server
    (through `pinned_eval.processes.start_process`), and records its PID (event `init`, `child`)."""

    def __init__(self, log: str) -> None:
        self.log = log
        spec = ProcessSpec(role="engine", command=[sys.executable, "-c", "import time\nwhile True: time.sleep(60)"])
        self.record, _ = start_process(spec, Path(log).with_suffix(".child.log"))
        _record(log, self, "init", child=self.record.pid)

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:
        return _results(input, input.weight_version)

    def dispose(self) -> None:
        stop_process(self.record)
