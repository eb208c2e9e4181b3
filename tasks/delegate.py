"""Delegate task: the suite's `eval.delegate` services against the pinned fleet (docs/harnesses.md).

A Prefect shell around `pinned_eval.delegate.run.DelegateRun`, run under the fleet lock right
after generation (or after the pin when generations came from the cache): one `PointSession` on
the fleet's router client (version `weight_version`, rid prefix `<rid_prefix>-delegate`), its
request count starting at `prior_requests` (the model calls the point's generation made), so the
point's `agent_max_requests` bounds the whole point. Returns the delegates' `eval/...` metrics.
Every gateway call of every delegate is written to the results store (when the sinks block has
one) as `delegate_calls.parquet` at the point, also when a delegate fails; a failed write is
logged (WARNING) and the point goes on. Failures map to skips (`pinned_eval.skip_mapping`):
`delegate_failed` naming the delegate, `pin_violation`, `agent_budget`, `unhealthy`.
"""

from __future__ import annotations

import asyncio
import json

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from blocks.fleet import FleetBlock
from pinned_eval.delegate.run import DelegateRun, delegate_limits
from pinned_eval.results.store import ResultsStore
from pinned_eval.rollout import PointSession
from pinned_eval.skip_mapping import fleet_skips
from pinned_eval.suite import EvalSuite

DELEGATE_CALLS = "delegate_calls.parquet"
CALLS_SCHEMA = pa.schema([
    ("delegate", pa.string()), ("route", pa.string()), ("sample_key", pa.string()), ("status", pa.int64()),
    ("weight_version", pa.string()), ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
    ("latency_s", pa.float64()), ("error", pa.string()),
])


async def _run(
    fleet: FleetBlock, suite: EvalSuite, step: int, version: str, rid_prefix: str, lora: str | None,
    prior_requests: int, job: list[DelegateRun],
) -> dict[str, float]:
    async with fleet.client() as client:
        session = PointSession(client.generator, expected_version=version, rid_prefix=f"{rid_prefix}-delegate",
                               lora=lora)
        limits = delegate_limits(suite.defaults, suite.fallbacks)
        run = DelegateRun(session, suite.delegates, suite.fallbacks, step, limits, prior_requests=prior_requests)
        job.append(run)
        return await run.run()


@task(cache_policy=NO_CACHE, task_run_name="delegate-{weight_version}")
def delegate(
    fleet: FleetBlock,
    suite: EvalSuite,
    run: str,
    step: int,
    weight_version: str,
    rid_prefix: str,
    results: ResultsStore | None = None,
    lora_path: str | None = None,
    prior_requests: int = 0,
) -> dict[str, float]:
    """The delegates' metrics (see the module docstring)."""
    logger = get_run_logger()
    job: list[DelegateRun] = []
    try:
        with fleet_skips():
            metrics = asyncio.run(_run(fleet, suite, step, weight_version, rid_prefix, lora_path, prior_requests, job))
    finally:
        if job:
            for name, reply in job[0].replies.items():
                logger.info("delegate %r replied: %.2000s", name, json.dumps(reply, default=str))
            if results is not None:
                _write_calls(results, run, step, job[0].calls)
    logger.info("delegates of %s/step-%d: %d metrics", run, step, len(metrics))
    return metrics


def _write_calls(results: ResultsStore, run: str, step: int, calls: list[dict[str, object]]) -> None:
    try:
        results.write(run, step, DELEGATE_CALLS, pa.Table.from_pylist(calls, schema=CALLS_SCHEMA))
    except Exception as exc:  # the record of calls is a debugging aid: the point keeps its outcome
        get_run_logger().warning("delegate calls of %s/step-%d not written: %s: %s", run, step,
                                 type(exc).__name__, exc)
