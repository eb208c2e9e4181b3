"""`trainer_integration` is imported by training jobs: it must work where Prefect is not installed."""

from __future__ import annotations

import subprocess
import sys

# Makes `import prefect` (and any submodule) raise ImportError in the child interpreter.
BLOCK_PREFECT = "import sys\nsys.modules['prefect'] = None\n"


def run_isolated(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_PREFECT + code], capture_output=True, text=True, timeout=120)


def test_producer_and_gate_import_without_prefect_or_torch() -> None:
    r = run_isolated(
        "import trainer_integration.producer, trainer_integration.gate, trainer_integration.rollout_buffer\n"
        "assert 'torch' not in sys.modules, 'the producer must stay torch-free'\n"
        "print('ok')\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_the_prefect_block_is_effective() -> None:
    r = run_isolated("import prefect\n")
    assert r.returncode != 0
    assert "ImportError" in r.stderr or "ModuleNotFoundError" in r.stderr


def test_flat_public_api_imports_without_prefect_or_torch() -> None:
    r = run_isolated(
        "from trainer_integration import EvalClient, CheckpointEvalFn, EvalSkip, ProducerGate, FullyAsyncProducer\n"
        "import pinned_eval.external as contract\n"
        "assert CheckpointEvalFn is contract.CheckpointEvalFn and issubclass(EvalSkip, Exception)\n"
        "assert 'torch' not in sys.modules, 'the trainer API must stay torch-free'\n"
        "print('ok')\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
