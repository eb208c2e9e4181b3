"""The generate task's progress artifact: at most every 5 %, never past 100 % when a work item
yields several samples (an lm-eval task yields one per document)."""

from __future__ import annotations

import uuid

import pytest

import tasks.generate as generate


def test_progress_stops_at_100_percent_when_items_yield_many_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    shown: list[float] = []
    monkeypatch.setattr(generate, "create_progress_artifact", lambda *a, **k: uuid.uuid4())
    monkeypatch.setattr(generate, "update_progress_artifact", lambda _id, pct: shown.append(pct))
    progress = generate._Progress(2, "run-1")  # two lm-eval tasks
    for _ in range(48):  # 24 documents each
        progress.tick()
    assert shown == [50.0, 100.0]
