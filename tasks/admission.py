"""Admission: the in-flight bound of a run, and the pin locks, as global concurrency limits.

Contract: `admitted(...)` holds one slot of `eval-inflight-<run>` (limit = max_in_flight) for the
body; under policy `skip` a full limit raises `EvalSkipped(BUSY)` at once, under `backpressure`
(and always for the final point) it waits. `pin_lock(name)` holds `fleet-<name>` (limit 1)
through pin and generate, or an external backend's `backend-<class>-<digest>` through its eval.
Limits are acquired with `strict=True` (a missing limit would otherwise mean *no* limit) and
created here when missing; an existing limit's size is left alone.
Leases are 60 s and renewed, so a SIGKILLed holder frees its slot within ~75 s.
A transient answer while acquiring (a 5xx: the SQLite server answers 503 under write bursts once
Prefect's client gave up its own retries; or a dropped connection) is retried with backoff for up
to `ACQUIRE_PATIENCE_SECONDS`; any other refusal (a 4xx, and a 423 under `skip`) is not.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

import httpx
from prefect import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from tenacity import Retrying, before_sleep_log, retry_if_exception, stop_after_delay, wait_exponential_jitter

from pinned_eval.points import inflight_limit_name
from pinned_eval.skips import EvalSkipped, SkipReason

LEASE_SECONDS = 60.0
ACQUIRE_PATIENCE_SECONDS = 300.0
logger = logging.getLogger(__name__)


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


def _is_transient(exc: BaseException) -> bool:
    """A server error (5xx) or a dropped connection behind a failed acquisition: worth another try."""
    if not isinstance(exc, ConcurrencySlotAcquisitionError):
        return False
    cause = exc.__cause__
    if isinstance(cause, httpx.HTTPStatusError):
        return cause.response.status_code >= 500
    return isinstance(cause, httpx.TransportError)


def _hold(stack: ExitStack, name: str, *, max_retries: int | None, patience_s: float) -> None:
    """Enter `concurrency(name)` on `stack`, retrying transient failures for up to `patience_s`."""
    for attempt in Retrying(
        retry=retry_if_exception(_is_transient),
        stop=stop_after_delay(patience_s),
        wait=wait_exponential_jitter(initial=1, max=20),
        before_sleep=before_sleep_log(logger, logging.WARNING),
        reraise=True,
    ):
        with attempt:
            stack.enter_context(
                concurrency(name, occupy=1, strict=True, max_retries=max_retries, lease_duration=LEASE_SECONDS)
            )


@contextmanager
def admitted(run: str, step: int, *, policy: str, final: bool, max_in_flight: int) -> Iterator[None]:
    """Hold one in-flight slot of `run` for the body, or raise EvalSkipped(BUSY) (skip policy)."""
    name = inflight_limit_name(run)
    ensure_limit(name, max_in_flight)
    wait = policy == "backpressure" or final
    stack = ExitStack()
    try:
        _hold(stack, name, max_retries=None if wait else 0, patience_s=ACQUIRE_PATIENCE_SECONDS)
    except ConcurrencySlotAcquisitionError as exc:
        if not wait and _is_locked(exc):
            raise EvalSkipped(SkipReason.BUSY, f"step {step}: {name} is full") from exc
        raise
    with stack:
        yield


@contextmanager
def exclusive(lock_name: str, *, patience_s: float = ACQUIRE_PATIENCE_SECONDS) -> Iterator[None]:
    """Hold the limit `lock_name` (size 1) for the body. Pin locks: one point pins and measures on
    a fleet (`fleet-<name>`) or an external backend configuration (`backend-<class>-<digest>`) at
    a time; `wandb-<eval run id>`: one writer of a dedicated W&B eval run at a time."""
    ensure_limit(lock_name, 1)
    with ExitStack() as stack:
        _hold(stack, lock_name, max_retries=None, patience_s=patience_s)
        yield


pin_lock = fleet_lock = exclusive
