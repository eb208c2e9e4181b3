"""Read TensorBoard event files back with TensorBoard's own reader (`EventAccumulator`)."""

from __future__ import annotations

from pathlib import Path


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files in `logdir`: tag -> [(step, value)] in file order,
    the value as written (float64 tensors, TensorBoard's scalar data class)."""
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(logdir), size_guidance={TENSORS: 0})  # 0: keep every event
    acc.Reload()
    return {
        tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
    }
