"""miles' `samples` key of a measured point (what --save-debug-rollout-data saves)."""

from __future__ import annotations

from pinned_eval.external import DatasetResult
from trainer_integration.miles_samples import miles_samples


def test_one_sample_per_response_prompt_major() -> None:
    result = DatasetResult(
        rewards=[1.0, None, 0.0],
        truncated=[False, True, False],
        weight_versions=["7", "7", None],
        response_lens=[3, 8, 0],
    )
    assert [s.to_dict() for s in miles_samples(result)] == [
        {"index": 0, "reward": 1.0, "response_length": 3, "status": "completed", "weight_versions": ["7"],
         "prompt": "", "response": ""},
        {"index": 1, "reward": None, "response_length": 8, "status": "truncated", "weight_versions": ["7"],
         "prompt": "", "response": ""},
        {"index": 2, "reward": 0.0, "response_length": 0, "status": "completed", "weight_versions": [],
         "prompt": "", "response": ""},
    ]
