"""The TensorBoard exporter: a point's metrics as TensorBoard scalars at the point's step.

Where (`SinksBlock.tensorboard_dir`, `.tensorboard`, `.results_root`):
- `tensorboard_dir` set (the trainer's log directory): into its subdirectory `eval`
  (`EVAL_SUBDIR`), which TensorBoard shows as the run `<trainer's run>/eval` beside the training
  curves. Not into the trainer's directory itself: TensorBoard reads the event files of one
  directory as written one at a time in name order, so a second writer there would make it stop
  reading the trainer's own file;
- else, with `tensorboard: true`: `<results_root>/<run>/tensorboard` (a local results root).
Each point writes one new event file (TensorBoard's own `EventFileWriter`) holding one event at
`step = record.step` with every metric of its ledger rows under the same name, as a float64 scalar
tensor of TensorBoard's scalar data class, so values read back are the JSONL's exactly (a
`simple_value` would round them to float32). One writer per directory at a time: the exporter
declares the lock `tensorboard-<hash of the directory>` (`exclusive`). The directory is checked
and created like every directory the product writes (`pinned_eval.trusted_paths`: whole-path
trust, new directories 0700). The `tensorboard` package is imported only when a point is logged.
"""

from __future__ import annotations

import hashlib
import os

from pinned_eval.sinks.exporters import BaseExporter, PointRecord, SinkSettings, register_exporter
from pinned_eval.trusted_paths import make_private_dirs

EVAL_SUBDIR = "eval"


class TensorboardExporter(BaseExporter):
    name = "tensorboard"

    def __init__(self, directory: str | None, results_root: str | None) -> None:
        self.directory = directory
        self.results_root = results_root

    def logdir(self, run: str) -> str:
        """Where `run`'s scalars go (see the module docstring)."""
        if self.directory:
            return os.path.join(self.directory, EVAL_SUBDIR)
        assert self.results_root, "the sinks block refuses tensorboard without a directory"
        return os.path.join(self.results_root, run, "tensorboard")

    def exclusive(self, record: PointRecord) -> str | None:
        return f"tensorboard-{hashlib.sha256(self.logdir(record.run).encode()).hexdigest()[:16]}"

    def export(self, record: PointRecord) -> None:
        import numpy as np
        from tensorboard.compat.proto import event_pb2, summary_pb2  # tensorboard: optional extra
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        from tensorboard.util import tensor_util

        logdir = self.logdir(record.run)
        make_private_dirs(logdir, "TensorBoard log directory")
        merged: dict[str, float] = {}
        for r in record.rows:
            merged.update(r.metrics)
        scalar = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
            data_class=summary_pb2.DataClass.DATA_CLASS_SCALAR,
        )
        event = event_pb2.Event(wall_time=record.rows[0].logged_at.timestamp(), step=record.step)
        for tag, value in merged.items():
            event.summary.value.add(tag=tag, tensor=tensor_util.make_tensor_proto(np.float64(value)), metadata=scalar)
        writer = EventFileWriter(logdir, filename_suffix=f".pinned-eval-step-{record.step}")
        try:
            writer.add_event(event)
        finally:
            writer.close()  # flushes; an I/O error surfaces here and the attempt is retried


def _build(settings: SinkSettings) -> TensorboardExporter | None:
    if not (settings.tensorboard or settings.tensorboard_dir):
        return None
    return TensorboardExporter(settings.tensorboard_dir, settings.results_root)


register_exporter("tensorboard", _build, order=34)
