"""`tasks.skip_logging`: the task engine's ERROR records of an expected skip become INFO lines
without traceback; every other record passes as it was. (End to end: tests/e2e/test_skip_logging.py.)"""

from __future__ import annotations

import logging
import sys

import pytest

from pinned_eval.skips import EvalSkipped
from tasks.skip_logging import TASK_RUN_LOGGER, ExpectedSkipFilter, quiet_expected_skips


def _record(level: int, msg: str, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = None
    if exc is not None:
        try:
            raise exc
        except BaseException:
            exc_info = sys.exc_info()
    return logging.LogRecord(TASK_RUN_LOGGER, level, __file__, 1, msg, None, exc_info)


def test_the_skip_raised_by_a_task_is_an_info_line_naming_its_reason() -> None:
    record = _record(logging.ERROR, "Task run failed with exception: %r", EvalSkipped("ckpt_missing", "/s: no marker"))
    record.args = (record.exc_info[1],)  # type: ignore[index]
    assert ExpectedSkipFilter().filter(record) is True
    assert (record.levelno, record.levelname, record.exc_info) == (logging.INFO, "INFO", None)
    assert record.getMessage() == "raised an expected skip (ckpt_missing): /s: no marker"


def test_the_failed_state_line_of_a_skip_is_info() -> None:
    msg = "Finished in state Failed('Task run encountered an exception EvalSkipped: busy: step 3: full')"
    record = _record(logging.ERROR, msg)
    assert ExpectedSkipFilter().filter(record) is True
    assert (record.levelno, record.getMessage()) == (logging.INFO, msg)


@pytest.mark.parametrize("exc", [RuntimeError("engine died"), ValueError("EvalSkipped: in a message")])
def test_other_errors_pass_unchanged(exc: Exception) -> None:
    record = _record(logging.ERROR, "Task run failed with exception: %r", exc)
    record.args = (exc,)
    assert ExpectedSkipFilter().filter(record) is True
    assert record.levelno == logging.ERROR and record.exc_info is not None and record.exc_info[1] is exc


def test_installed_once_on_the_task_engine_logger() -> None:
    logger = logging.getLogger(TASK_RUN_LOGGER)
    before = [f for f in logger.filters if isinstance(f, ExpectedSkipFilter)]
    quiet_expected_skips()
    quiet_expected_skips()
    assert len([f for f in logger.filters if isinstance(f, ExpectedSkipFilter)]) == 1
    for f in [f for f in logger.filters if isinstance(f, ExpectedSkipFilter)][len(before):]:
        logger.removeFilter(f)
