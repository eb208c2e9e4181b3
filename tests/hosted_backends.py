"""External backends for the backend-host tests: each writes its lifecycle to a JSONL file, since
it runs in another process (the host) than the test that checks it."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from pinned_eval.external import CheckpointEvalFn, DatasetResult, EvalInput, EvalResults, EvalSkip


def read_lifecycle(path: str) -> list[dict[str, Any]]:
    """The recorded events, in order (an absent file: none yet)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
        line = {"event": event, "pid": os.getpid(), "instance": id(self), "version": version, "t": time.time()}
        with open(self.log, "a") as f:
            f.write(json.dumps(line) + "\n")

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
        return EvalResults(
            data={
                ds.name: DatasetResult(
                    rewards=[1.0] * 6, truncated=[False] * 6, weight_versions=[v] * 6, response_lens=[1] * 6
                )
                for ds in input.datasets
            }
        )

    def dispose(self) -> None:
        self._write("dispose")
