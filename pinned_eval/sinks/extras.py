"""Optional trackers are extras: a sinks block that needs one that is not installed is refused
when it loads (`missing_extra`), not when the first point logs. `TRACKER_MODULES`: the slow
modules each tracker's sink imports when it first logs, which the warm-start server imports
before it forks flow runs (`installed_tracker_modules`)."""

from __future__ import annotations

import importlib.util


def missing_extra(module: str, extra: str) -> str | None:
    """None when `module` can be imported, else the refusal naming the extra to install. Cheap:
    finds the module without importing it (MLflow's import takes seconds)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken entry in sys.modules
        found = False
    if found:
        return None
    return f"needs the optional package {module!r}: pip install 'pinned-eval[{extra}]'"


# What `pinned_eval.sinks.wandb`, `.mlflow` and `.tensorboard` import inside their first export.
TRACKER_MODULES: dict[str, tuple[str, ...]] = {
    "wandb": ("wandb",),
    "mlflow": ("mlflow", "mlflow.entities", "mlflow.exceptions"),
    "tensorboard": ("numpy", "tensorboard.compat.proto.event_pb2", "tensorboard.compat.proto.summary_pb2",
                    "tensorboard.summary.writer.event_file_writer", "tensorboard.util.tensor_util"),
}


def installed_tracker_modules() -> list[str]:
    """The `TRACKER_MODULES` of every tracker that is installed (found without importing it)."""
    return [m for tracker, modules in TRACKER_MODULES.items() if missing_extra(tracker, tracker) is None
            for m in modules]
