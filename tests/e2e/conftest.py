"""Fixtures for end-to-end tests: a tiny offline model and real CPU engine processes.

- `tiny_model_dir` (session): a tiny Llama snapshot written by `engine.tiny_model.make_tiny_model`.
- `start_engine` (function): `start_engine(model_path, port=None, weight_version="default",
  extra_args=(), api_key=None, admin_api_key=None) -> EngineProcess`; starts
  `python -m engine` on 127.0.0.1, waits for `/health_generate` 200, and kills every
  engine it started by PID at teardown. `EngineStarter` is the same thing for wider scopes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from pinned_eval.fleet.cpu_engine import CpuEngineArgs, EngineProcess, spawn_engine
from tests.conftest import free_port


class EngineStarter:
    """Starts engine processes with logs under `log_dir`; `stop_all()` kills them by PID."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.started: list[EngineProcess] = []

    def __call__(
        self,
        model_path: str | Path,
        port: int | None = None,
        weight_version: str = "default",
        extra_args: Sequence[str] = (),
        api_key: str | None = None,
        admin_api_key: str | None = None,
        ready_timeout: float = 120.0,
    ) -> EngineProcess:
        port = port or free_port()
        args = CpuEngineArgs(
            model_path=str(model_path),
            port=port,
            weight_version=weight_version,
            api_key=api_key,
            admin_api_key=admin_api_key,
        )
        engine = spawn_engine(args, self.log_dir / f"engine-{port}.log", extra_args=extra_args)
        self.started.append(engine)
        engine.wait_ready(timeout=ready_timeout)
        return engine

    def stop_all(self) -> None:
        for engine in self.started:
            engine.stop()
        self.started.clear()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model") / "base", arch="llama", seed=0)


@pytest.fixture
def start_engine(tmp_path: Path) -> Iterator[EngineStarter]:
    starter = EngineStarter(tmp_path / "engine-logs")
    try:
        yield starter
    finally:
        starter.stop_all()
