"""Every alert and admission rule at exactly its boundary, and at the nearest value past it.

Values are exact binary fractions (0.75 - 0.5 == 0.25 exactly) and `math.nextafter` gives the
nearest float on the other side, so "exactly at" and "just past" are exact inputs, never a
duration: clocks are the modules' `time`, replaced by a counter the test sets.

- the regression alert (`pinned_eval.scoring.regression`): a drop *exactly at* `threshold` is no
  regression, the least larger one is; a baseline exactly at `ci95_high` is explained by the
  interval, the least one above it is not; an earlier point at the *same* step is no baseline;
- admission (`trainer_integration.admission`): `max_in_flight - 1` others admitted, `max_in_flight`
  busy (`tests/fast/test_eval_client.py::test_skip_policy_admits_up_to_exactly_the_bound`); a
  request holds its slot until exactly `visible_timeout_s` after it was noted, not a tick longer;
- engine health (`pinned_eval.fleet.health`): a 503 is busy until exactly `dead_after_s`, dead from it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

import pinned_eval.fleet.health as health_mod
import trainer_integration.admission as admission_mod
from pinned_eval.events import BlockNames
from pinned_eval.fleet.health import EngineRecord, engine_health
from pinned_eval.fleet.models import HealthState
from pinned_eval.points import PointRequest, SnapshotSource
from pinned_eval.scoring.regression import Regression, RegressionRule
from trainer_integration.admission import AdmissionView
from trainer_integration.events import event_entry

BASE = [(10, {"eval/ds": 0.75})]
BELOW = math.nextafter  # nextafter(x, 0): the nearest float below a positive x


def _at(value: float, high: float | None = None) -> dict[str, float]:
    return {"eval/ds": value, **({"eval/ds/ci95_high": high} if high is not None else {})}


# ---- the regression alert -----------------------------------------------------------------------


@pytest.mark.parametrize("baseline", ["best", "previous"])
def test_a_drop_exactly_at_the_threshold_is_no_regression_and_the_least_larger_one_is(baseline: str) -> None:
    at = RegressionRule(baseline=baseline, threshold=0.25, outside_interval=False)  # type: ignore[arg-type]
    assert 0.75 - 0.5 == 0.25 and at.check("ds", 20, _at(0.5), BASE) is None
    past = RegressionRule(baseline=baseline, threshold=BELOW(0.25, 0), outside_interval=False)  # type: ignore[arg-type]
    assert past.check("ds", 20, _at(0.5), BASE) == Regression(
        dataset="ds", metric="eval/ds", value=0.5, baseline=0.75, baseline_step=10, drop=0.25, ci95_high=None)


def test_with_threshold_zero_an_equal_value_is_no_regression_and_the_least_drop_is() -> None:
    rule = RegressionRule(outside_interval=False)
    assert rule.threshold == 0.0 and rule.check("ds", 20, _at(0.75), BASE) is None
    found = rule.check("ds", 20, _at(BELOW(0.75, 0)), BASE)
    assert found is not None and found.drop == 0.75 - BELOW(0.75, 0) > 0


def test_a_baseline_exactly_at_the_interval_top_is_explained_and_the_least_one_above_it_is_not() -> None:
    rule = RegressionRule()
    assert rule.outside_interval and rule.check("ds", 20, _at(0.5, high=0.75), BASE) is None
    found = rule.check("ds", 20, _at(0.5, high=BELOW(0.75, 0)), BASE)
    assert found == Regression(dataset="ds", metric="eval/ds", value=0.5, baseline=0.75, baseline_step=10,
                               drop=0.25, ci95_high=BELOW(0.75, 0))


def test_an_earlier_point_at_the_same_step_is_no_baseline_and_one_step_before_is() -> None:
    rule = RegressionRule(outside_interval=False)
    assert rule.check("ds", 10, _at(0.5), BASE) is None
    found = rule.check("ds", 11, _at(0.5), BASE)
    assert found is not None and (found.baseline_step, found.drop) == (10, 0.25)


def test_best_ties_take_the_earliest_step() -> None:
    history = [(30, {"eval/ds": 0.75}), (10, {"eval/ds": 0.75}), (20, {"eval/ds": 0.5})]
    found = RegressionRule(outside_interval=False).check("ds", 40, _at(0.5), history)
    assert found is not None and (found.baseline, found.baseline_step) == (0.75, 10)


# ---- admission: the visibility timeout ----------------------------------------------------------


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


def test_a_request_holds_its_slot_until_exactly_the_visibility_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock(1000.0)
    monkeypatch.setattr(admission_mod, "time", SimpleNamespace(monotonic=clock.monotonic))
    view = AdmissionView("exp", visible_timeout_s=8.0)
    view.refresh([], set())  # fresh: admission is decided, not offline
    source = SnapshotSource(kind="hf", path="/ckpt/1", require_marker=False)
    view.note(event_entry(PointRequest(run="exp", step=1, source=source), BlockNames()))  # noted at 1000

    def decide(step: int) -> tuple[str, int]:
        verdict, n, _, offline = view.decide(step, final=False, policy="skip", max_in_flight=1, spooled=set,
                                             poll_s=0.01, wake=lambda: None)
        assert not offline
        return verdict, n

    clock.now = BELOW(1008.0, 0)
    assert decide(2) == ("busy", 1)  # the last tick before the timeout: still in flight
    clock.now = 1008.0
    assert decide(3) == ("ok", 0)  # exactly at it: its slot is free


# ---- engine health: dead_after_s ------------------------------------------------------------------


class _Answers503:
    """An engine answering 503 on /health while /model_info answers (busy, not dead, until the deadline)."""

    async def health(self, url: str) -> int:
        return 503

    async def model_info(self, url: str) -> dict[str, Any]:
        return {"weight_version": "5"}

    async def server_info(self, url: str) -> dict[str, Any]:
        return {}


async def test_a_503_is_busy_until_exactly_dead_after_s_and_dead_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock(1000.0)
    monkeypatch.setattr(health_mod, "time", SimpleNamespace(monotonic=clock.monotonic))
    rec = EngineRecord(url="http://127.0.0.1:1")
    api: Any = _Answers503()
    first = await engine_health(api, rec, dead_after_s=30.0)
    assert (first.state, rec.unhealthy_since) == (HealthState.BUSY, 1000.0)
    clock.now = BELOW(1030.0, 0)
    assert (await engine_health(api, rec, dead_after_s=30.0)).state is HealthState.BUSY
    clock.now = 1030.0
    dead = await engine_health(api, rec, dead_after_s=30.0)
    assert (dead.state, dead.detail) == (HealthState.DEAD, "503 for 30s with no load in flight")
