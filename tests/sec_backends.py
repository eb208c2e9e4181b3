"""External backends for the payload-security tests (importable by a deployed worker, whose
working directory is the project): one proves it was built, one records the options it got."""

from __future__ import annotations

import json
from pathlib import Path

from pinned_eval.external import CheckpointEvalFn, DatasetResult, EvalInput, EvalResults


class PlantedBackend(CheckpointEvalFn):
    """What an attacker names in a payload: constructing it creates `marker` (code ran as the worker)."""

    def __init__(self, marker: str) -> None:
        Path(marker).touch()

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:
        raise AssertionError("a planted backend must never run")


class RecordingBackend(CheckpointEvalFn):
    """An operator's backend: writes the keywords it was built with to `record`, measures 1.0."""

    def __init__(self, record: str, api_key: str) -> None:
        Path(record).write_text(json.dumps({"record": record, "api_key": api_key}))

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:
        v = input.weight_version
        return EvalResults(data={
            ds.name: DatasetResult(rewards=[1.0], truncated=[False], weight_versions=[v], response_lens=[1])
            for ds in input.datasets
        })
