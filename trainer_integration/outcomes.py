"""How the trainer side reads its points' outcomes (no Prefect import): `EvalClient`'s
`results()`, `best(metric)`, `wait_for(step)` and `drain(timeout)`.

Reads: the run's eval-point flow runs over REST (`POST /flow_runs/filter`, the newest run of a
step decides its state, `trainer_integration.results.point_outcome`) and the metrics of measured
points from the JSONL sink file named by the saved sinks block (read over REST once per call).
`wait_for` and `best` read only the steps they need (`outcomes_of`: the steps' flow runs by
name, and what is in flight), `results()` every step (what it returns). Every call is network
and file I/O: the training loop calls them between steps or at the end, never per step, and
`dispatch` never calls them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pinned_eval.polling import PollTimeout, poll_until
from pinned_eval.sinks import Ledger
from trainer_integration.events import SINKS_BLOCK_SLUG
from trainer_integration.rest import PointRun
from trainer_integration.results import PointOutcome, best_of, point_outcome

if TYPE_CHECKING:
    from pinned_eval.events import BlockNames
    from trainer_integration.admission import AdmissionView
    from trainer_integration.rest import PrefectRest
    from trainer_integration.spool import Deliverer, Spool

log = logging.getLogger(__name__)
BEST_BATCH = 20


class PointOutcomes:
    """The outcome readers of `EvalClient` (a mixin: it sets every attribute declared here)."""

    run: str
    rest: PrefectRest
    blocks: BlockNames
    admission: AdmissionView
    deliverer: Deliverer
    spool: Spool
    poll_s: float

    def steps(self) -> list[int]:
        return sorted(self.admission.steps())

    def results(self) -> list[PointOutcome]:
        """Each step's outcome (requested by this client or seen on the server), by step."""
        runs = self.rest.point_runs(self.run)
        rows = self._sink_rows()
        self.admission.seen({r.step for r in runs})
        by_step: dict[int, list[PointRun]] = {}
        for r in runs:
            by_step.setdefault(r.step, []).append(r)
        return [point_outcome(s, by_step.get(s, []), rows.get(s, {})) for s in sorted(set(by_step) | set(self.steps()))]

    def outcomes_of(self, steps: list[int]) -> list[PointOutcome]:
        """The outcomes of `steps` only, by step: their flow runs (`PrefectRest.step_point_runs`,
        one request per 200 steps) and their sink rows, never the run's whole history."""
        rows = self._sink_rows(steps)
        return self._outcomes_at(steps, rows)

    def _outcomes_at(self, steps: list[int], rows: dict[int, dict[str | None, dict[str, float]]]) -> list[PointOutcome]:
        runs = self.rest.step_point_runs(self.run, steps)
        self.admission.seen({r.step for r in runs})
        by_step: dict[int, list[PointRun]] = {}
        for r in runs:
            by_step.setdefault(r.step, []).append(r)
        return [point_outcome(s, by_step.get(s, []), rows.get(s, {})) for s in sorted(set(steps))]

    def best(self, metric: str, *, mode: Literal["max", "min"] = "max") -> PointOutcome | None:
        """The measured point with the highest (`mode="min"`: lowest) `metric`, e.g. `eval/arith_add`
        or `eval/arith_add-pass@4`; ties go to the earliest step; None when no measured point has it.

        Ranked from the JSONL sink's rows, then only the best `BEST_BATCH` candidates' flow runs are
        read (one request; the next batch only when none of them still stands measured)."""
        rows = self._sink_rows()
        sign = 1.0 if mode == "max" else -1.0
        scores = {s: v for s, by_ds in rows.items()
                  if (v := next((m[metric] for ds, m in by_ds.items() if ds is not None and metric in m), None))
                  is not None}  # fmt: skip
        ranked = sorted(scores, key=lambda s: (-sign * scores[s], s))
        for i in range(0, len(ranked), BEST_BATCH):
            found = best_of(self._outcomes_at(ranked[i : i + BEST_BATCH], rows), metric, mode=mode)
            if found is not None:
                return found
        return None

    def _sink_rows(self, steps: list[int] | None = None) -> dict[int, dict[str | None, dict[str, float]]]:
        """The sink rows of the run (of `steps` only: the ledger's other lines are not parsed)."""
        data = self.rest.block_data(SINKS_BLOCK_SLUG, self.blocks.sinks)
        path = (data or {}).get("jsonl_path")
        out: dict[int, dict[str | None, dict[str, float]]] = {}
        if path and Path(path).exists():
            for row in Ledger(path).read(self.run, steps=set(steps) if steps is not None else None):
                out.setdefault(row.step, {})[row.dataset] = row.metrics
        return out

    def wait_for(self, step: int, timeout: float) -> PointOutcome:
        def outcome() -> PointOutcome:  # the step's flow runs only (`outcomes_of`)
            return self.outcomes_of([step])[0]

        def done() -> PointOutcome | None:
            o = outcome()
            return o if o.state != "pending" else None

        with contextlib.suppress(PollTimeout):  # still pending at the timeout: returned as pending
            return poll_until(done, timeout_s=timeout, interval_s=self.poll_s, what="")
        return outcome()

    def drain(self, timeout: float) -> list[PointOutcome]:
        """Deliver the spool, then wait until every point is terminal (pending ones stay `pending`)."""
        deadline = time.monotonic() + timeout
        if not self.deliverer.flush(timeout):
            log.warning("pinned-eval: %d requests of %s still spooled", len(self.spool.pending()), self.run)

        def settled() -> list[PointOutcome] | None:
            outcomes = self.results()
            return outcomes if all(o.state != "pending" for o in outcomes) else None

        with contextlib.suppress(PollTimeout):  # pending ones at the timeout stay `pending`
            return poll_until(settled, timeout_s=max(0.0, deadline - time.monotonic()), interval_s=self.poll_s, what="")
        return self.results()
