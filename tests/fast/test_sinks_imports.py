"""The ledger is read by the trainer side (`trainer_integration.events`, `.outcomes`): importing
`pinned_eval.sinks` pulls neither Prefect, nor W&B, MLflow, TensorBoard or pyarrow (they load when a point
is logged)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules['prefect'] = None
import trainer_integration.events, trainer_integration.outcomes, pinned_eval.sinks
from pinned_eval.sinks import EXPORTERS, Ledger
print(sorted(EXPORTERS), sorted(m for m in ('wandb', 'pyarrow', 'mlflow', 'tensorboard') if m in sys.modules))
"""


def test_the_sinks_core_imports_without_prefect_wandb_or_pyarrow() -> None:
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['mlflow', 'tensorboard', 'wandb'] []"  # the Prefect-side ones register from `tasks`
