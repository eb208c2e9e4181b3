"""The trainer's progress as the flow sees it: its latest reported step and a point's lag behind it.

`trainer_step` reads the Prefect Variable the trainer side updates
(`pinned_eval.points.progress_variable_name`; `trainer_integration.progress` writes it); `lag_steps`
is how many steps the trainer is past `step`, 0 when it reported none or is behind.
"""

from __future__ import annotations

from prefect.variables import Variable

from pinned_eval.points import progress_variable_name


def trainer_step(run: str) -> int | None:
    """The trainer's latest reported step (a Prefect Variable the trainer side updates)."""
    value = Variable.get(progress_variable_name(run), default=None)
    return int(value) if value is not None else None


def lag_steps(run: str, step: int) -> int:
    latest = trainer_step(run)
    return max(latest - step, 0) if latest is not None else 0
