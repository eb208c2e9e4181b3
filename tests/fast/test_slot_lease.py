"""The slot lease setting (`PINNED_EVAL_SLOT_LEASE_S`): default, bounds, and its way into a
warm-started flow run (a deployment's job-variable `env`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.warm_start.server import flow_run_env
from pinned_eval.settings import get_settings


def test_the_lease_is_60_s_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PINNED_EVAL_SLOT_LEASE_S", raising=False)
    assert get_settings().slot_lease_s == 60.0
    monkeypatch.setenv("PINNED_EVAL_SLOT_LEASE_S", "30")
    assert get_settings().slot_lease_s == 30.0


@pytest.mark.parametrize("value", ["9.5", "3601", "soon"])
def test_a_lease_out_of_bounds_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("PINNED_EVAL_SLOT_LEASE_S", value)
    with pytest.raises(ValidationError) as info:
        get_settings()
    assert [e["loc"] for e in info.value.errors()] == [("slot_lease_s",)]


def test_a_job_variable_lease_reaches_the_warm_started_flow_run() -> None:
    env = flow_run_env({"PATH": "/usr/bin"}, {"PINNED_EVAL_SLOT_LEASE_S": "30", "PATH": "/tmp/evil"})
    assert (env["PINNED_EVAL_SLOT_LEASE_S"], env["PATH"]) == ("30", "/usr/bin")
