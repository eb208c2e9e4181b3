"""Admission: the in-flight bound of a run, and the pin locks, as global concurrency limits.

Contract: `admitted(...)` holds one slot of `eval-inflight-<run>` (limit = max_in_flight) for the
body; under policy `skip` a full limit raises `EvalSkipped(BUSY)` at once, under `backpressure`
(and always for the final point) it waits. `pin_lock(name)` holds `fleet-<name>` (limit 1)
through pin and generate, or an external backend's `backend-<class>-<digest>` through its eval.
Limits are acquired with `strict=True` (a missing limit would otherwise mean *no* limit) and
created here when missing; an existing limit's size is left alone.
Leases are 60 s and renewed, so a SIGKILLed holder frees its slot within ~75 s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

from prefect import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from pinned_eval.points import inflight_limit_name
from pinned_eval.skips import EvalSkipped, SkipReason

LEASE_SECONDS = 60.0


class _QuietSkipNoise(logging.Filter):
    """The slot service logs an ERROR traceback on every 423 (a normal `skip` outcome)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "ConcurrencySlotAcquisition" not in record.getMessage()


logging.getLogger("prefect._internal.concurrency").addFilter(_QuietSkipNoise())


def ensure_limit(name: str, limit: int) -> None:
    """Create the global concurrency limit `name` with `limit` slots unless it exists.

    Safe when points of the same run (or fleet) start at once: a limit another caller created
    between our read and our create is kept as it is.
    """
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with suppress(ObjectAlreadyExists):  # created by a concurrent point just now
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))


def _is_locked(exc: ConcurrencySlotAcquisitionError) -> bool:
    response = getattr(exc.__cause__, "response", None)
    return getattr(response, "status_code", None) == 423


@contextmanager
def admitted(run: str, step: int, *, policy: str, final: bool, max_in_flight: int) -> Iterator[None]:
    """Hold one in-flight slot of `run` for the body, or raise EvalSkipped(BUSY) (skip policy)."""
    name = inflight_limit_name(run)
    ensure_limit(name, max_in_flight)
    wait = policy == "backpressure" or final
    stack = ExitStack()
    try:
        stack.enter_context(
            concurrency(
                name,
                occupy=1,
                strict=True,
                max_retries=None if wait else 0,
                lease_duration=LEASE_SECONDS,
            )
        )
    except ConcurrencySlotAcquisitionError as exc:
        if not wait and _is_locked(exc):
            raise EvalSkipped(SkipReason.BUSY, f"step {step}: {name} is full") from exc
        raise
    with stack:
        yield


@contextmanager
def exclusive(lock_name: str) -> Iterator[None]:
    """Hold the limit `lock_name` (size 1) for the body. Pin locks: one point pins and measures on
    a fleet (`fleet-<name>`) or an external backend configuration (`backend-<class>-<digest>`) at
    a time; `wandb-<eval run id>`: one writer of a dedicated W&B eval run at a time."""
    ensure_limit(lock_name, 1)
    with concurrency(lock_name, occupy=1, strict=True, lease_duration=LEASE_SECONDS):
        yield


pin_lock = fleet_lock = exclusive
