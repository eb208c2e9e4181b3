"""An expected skip is no error in the logs: Prefect's task engine reports any exception a task
raises at ERROR, with its traceback ("Task run failed with exception: ..."), and the task's end
("Finished in state Failed(... EvalSkipped: ...)") at ERROR. An `EvalSkipped` is the point's
typed outcome (its flow ends Completed named "Skipped" and logs one WARNING naming the reason), so
`quiet_expected_skips()` turns both task records into INFO lines without traceback. Any other
exception is logged as Prefect logs it.
"""

from __future__ import annotations

import logging

from pinned_eval.skips import EvalSkipped

TASK_RUN_LOGGER = "prefect.task_runs"  # the logger of Prefect's task engine
_SKIPPED_STATE = "exception EvalSkipped: "  # in the Failed state: "... an exception EvalSkipped: <reason>: ..."


class ExpectedSkipFilter(logging.Filter):
    """Rewrites the task engine's ERROR records of an `EvalSkipped` to INFO, without traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, EvalSkipped):
            record.msg, record.args = "raised an expected skip (%s): %s", (exc.reason, exc.message)
            record.exc_info, record.exc_text = None, None
        elif _SKIPPED_STATE not in record.getMessage():
            return True
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def quiet_expected_skips() -> None:
    """Install `ExpectedSkipFilter` on the task engine's logger (once; later calls do nothing)."""
    logger = logging.getLogger(TASK_RUN_LOGGER)
    if not any(isinstance(f, ExpectedSkipFilter) for f in logger.filters):
        logger.addFilter(ExpectedSkipFilter())
