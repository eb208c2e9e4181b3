"""Admission against a real Prefect server: the in-flight limit skips or waits, and never leaks."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from unittest import mock

import pytest
from prefect import get_client
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from pinned_eval.points import inflight_limit_name
from pinned_eval.skips import EvalSkipped, SkipReason
from tasks.admission import _hold, admitted, ensure_limit, exclusive
from tests.reliability.netfaults import FaultyHTTPProxy, Rule
from tests.slots import SlotHolder, refusals

pytestmark = pytest.mark.e2e


def active_slots(name: str) -> int:
    with get_client(sync_client=True) as c:
        return c.read_global_concurrency_limit_by_name(name).active_slots


def test_skip_policy_skips_busy_when_full_and_final_waits(prefect_server: str) -> None:
    run = "adm-skip"
    with admitted(run, 1, policy="skip", final=False, max_in_flight=1):
        assert active_slots(inflight_limit_name(run)) == 1
        with pytest.raises(EvalSkipped) as info, admitted(run, 2, policy="skip", final=False, max_in_flight=1):
            pytest.fail("admitted past a full limit")
        assert info.value.reason == SkipReason.BUSY

    # the final point waits instead of skipping: the holder releases only once the final point's
    # request for a slot was refused (423), so the order proves the wait, not a duration
    order: list[str] = []
    with SlotHolder(run, 3, order) as holder, refusals(order, "final refused") as refused:
        holder.release_when(refused)
        with admitted(run, 4, policy="skip", final=True, max_in_flight=1):
            order.append("final admitted")
    assert order == ["held", "final refused", "releasing", "final admitted"]
    assert active_slots(inflight_limit_name(run)) == 0


def test_skip_policy_admits_up_to_exactly_the_bound(prefect_server: str) -> None:
    """With max_in_flight=2: one slot held, the next point is admitted; two held, it is busy."""
    run = f"adm-bound-{uuid.uuid4().hex[:8]}"
    with admitted(run, 1, policy="skip", final=False, max_in_flight=2):
        with admitted(run, 2, policy="skip", final=False, max_in_flight=2):
            assert active_slots(inflight_limit_name(run)) == 2
            with pytest.raises(EvalSkipped) as info, admitted(run, 3, policy="skip", final=False, max_in_flight=2):
                pytest.fail("admitted past a full limit")
            assert info.value.reason == SkipReason.BUSY
        assert active_slots(inflight_limit_name(run)) == 1
    assert active_slots(inflight_limit_name(run)) == 0


def test_a_slot_of_a_limit_that_does_not_exist_is_refused_never_granted(prefect_server: str) -> None:
    """`strict=True`: a limit deleted (or never created) is an error, not an unlimited slot."""
    name = f"adm-missing-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack, pytest.raises(ConcurrencySlotAcquisitionError):
        _hold(stack, name, max_retries=0, patience_s=0)
    with get_client(sync_client=True) as c, pytest.raises(ObjectNotFound):
        c.read_global_concurrency_limit_by_name(name)  # nothing was created on the way


def test_existing_limit_size_is_kept(prefect_server: str) -> None:
    run = "adm-size"
    ensure_limit(inflight_limit_name(run), 3)
    ensure_limit(inflight_limit_name(run), 1)
    with get_client(sync_client=True) as c:
        assert c.read_global_concurrency_limit_by_name(inflight_limit_name(run)).limit == 3


def test_points_starting_at_once_create_the_limit_once(prefect_server: str) -> None:
    """Every caller reads "not found" first, then all create: the losers must not fail."""
    from concurrent.futures import ThreadPoolExecutor

    from prefect.client.orchestration import SyncPrefectClient

    name = inflight_limit_name(f"adm-race-{uuid.uuid4().hex[:8]}")
    barrier = threading.Barrier(6)
    read = SyncPrefectClient.read_global_concurrency_limit_by_name

    def read_then_wait(self, limit_name):  # type: ignore[no-untyped-def]
        try:
            return read(self, limit_name)
        finally:
            barrier.wait(30)  # nobody creates before everybody has read

    with (
        mock.patch.object(SyncPrefectClient, "read_global_concurrency_limit_by_name", read_then_wait),
        ThreadPoolExecutor(6) as pool,
    ):
        results = list(pool.map(lambda _: ensure_limit(name, 2), range(6)))
    assert results == [None] * 6
    with get_client(sync_client=True) as c:
        assert c.read_global_concurrency_limit_by_name(name).limit == 2


def test_blocks_register_with_the_prefect_cli(prefect_server: str) -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, PREFECT_API_URL=prefect_server)
    out = subprocess.run(
        [sys.executable, "-m", "prefect", "block", "register", "-m", "blocks"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    with get_client(sync_client=True) as c:
        slugs = {bt.slug for bt in c.read_block_types()}
    assert {"pinned-eval-fleet", "pinned-eval-staging", "pinned-eval-suite", "pinned-eval-sinks"} <= slugs


@pytest.fixture
def api_through(prefect_server: str) -> Iterator[Callable[..., FaultyHTTPProxy]]:
    """`api_through(*rules)`: this test's Prefect client talks to the real server through a fault
    proxy, with Prefect's own client retries off so every injected answer reaches admission."""
    proxies: list[FaultyHTTPProxy] = []
    upstream = prefect_server.removesuffix("/api")

    def through(*rules: Rule) -> FaultyHTTPProxy:
        proxies.append(FaultyHTTPProxy(upstream, list(rules)))
        return proxies[-1]

    yield through
    for p in proxies:
        p.close()


def _lease_posts(proxy: FaultyHTTPProxy) -> list[str]:
    return [s.action for s in proxy.requests if "increment-with-lease" in s.path]


@pytest.mark.parametrize("fault", ["error", "drop"])
def test_a_transient_server_error_while_acquiring_is_retried(api_through, fault: str) -> None:
    """The CI failure this fixes: a SQLite server answered 503 for a minute of a write burst, past
    Prefect's own retries, and the point crashed instead of waiting for the fleet lock."""
    name = f"fleet-transient-{fault}-{uuid.uuid4().hex[:8]}"
    proxy = api_through(Rule(fault, methods=("POST",), path_contains="increment-with-lease", times=2, status=503))  # type: ignore[arg-type]
    with temporary_settings({PREFECT_API_URL: f"{proxy.url}/api", PREFECT_CLIENT_MAX_RETRIES: 0}):
        with exclusive(name, patience_s=60):
            assert active_slots(name) == 1
        assert active_slots(name) == 0
    assert _lease_posts(proxy) == [fault, fault, "pass"]


@pytest.mark.parametrize(
    ("status", "patience_s"),
    [(400, 60), (503, 0)],
    ids=["client-error-not-retried", "transient-past-the-patience"],
)
def test_an_error_that_is_not_retried_is_raised_after_one_try(api_through, status: int, patience_s: float) -> None:
    """A 4xx is never retried; a 5xx is not once no patience is left after the first try."""
    name = f"fleet-once-{status}-{uuid.uuid4().hex[:8]}"
    proxy = api_through(Rule("error", methods=("POST",), path_contains="increment-with-lease", status=status))
    with (
        temporary_settings({PREFECT_API_URL: f"{proxy.url}/api", PREFECT_CLIENT_MAX_RETRIES: 0}),
        pytest.raises(ConcurrencySlotAcquisitionError, match=str(status)),
        exclusive(name, patience_s=patience_s),
    ):
        pytest.fail("entered the body without the lock")
    assert _lease_posts(proxy) == ["error"]
