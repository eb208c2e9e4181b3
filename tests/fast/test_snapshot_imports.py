"""The snapshot package is what training jobs import: it must not pull in Prefect."""

from __future__ import annotations

import subprocess
import sys


def test_snapshot_modules_import_without_prefect() -> None:
    code = (
        "import sys\n"
        "import pinned_eval.snapshot.writer, pinned_eval.snapshot.check, pinned_eval.snapshot.staging\n"
        "import pinned_eval.snapshot.state_dict, pinned_eval.snapshot.lora, app.commands.snapshot\n"
        "bad = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_check_and_staging_do_not_need_torch() -> None:
    code = (
        "import sys\n"
        "import pinned_eval.snapshot.check, pinned_eval.snapshot.staging\n"
        "assert 'torch' not in sys.modules, 'check/staging must stay light'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
