"""Start CPU engines as processes: the command line, the spawn, the readiness wait, the stop.

Shared by the fleet launcher and the tests, so every engine process starts the same way.
Contract:
- `EngineArgs` is the engine's whole configuration (validated; errors name the field). The CLI
  (`pinned-eval engine serve`) and `python -m engine` both build one.
- `engine_command(args)` returns the argv of `python -m pinned_eval.cli engine serve ...` for the
  running interpreter, so a child uses the same virtualenv.
- `spawn_engine(args, log_path)` starts it (stdout+stderr appended to `log_path`) and
  `EngineProcess.wait_ready(timeout)` polls `GET /health_generate` until 200; it raises
  `EngineStartError` (with the log tail) if the process exits or the deadline passes.
- `EngineProcess.stop()` terminates exactly that PID (SIGTERM, then SIGKILL after a grace period).
This module imports no torch, so launchers stay light.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field


class EngineArgs(BaseModel):
    """Startup configuration of one CPU engine (mirrors the SGLang ServerArgs it needs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str
    port: int = Field(ge=1, le=65535)
    host: str = "127.0.0.1"
    weight_version: str = "default"
    served_model_name: str | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    threads: int = Field(default=1, ge=1)
    max_batch_size: int = Field(default=64, ge=1)
    context_length: int | None = Field(default=None, ge=2)
    health_timeout_s: float = Field(default=20.0, gt=0)

    def cli_args(self) -> list[str]:
        """The `engine serve` flags that reproduce these args."""
        argv = [
            "--model-path",
            self.model_path,
            "--port",
            str(self.port),
            "--host",
            self.host,
            "--weight-version",
            self.weight_version,
            "--threads",
            str(self.threads),
            "--max-batch-size",
            str(self.max_batch_size),
            "--health-timeout",
            str(self.health_timeout_s),
        ]
        optional = {
            "--served-model-name": self.served_model_name,
            "--api-key": self.api_key,
            "--admin-api-key": self.admin_api_key,
            "--context-length": self.context_length,
        }
        for flag, value in optional.items():
            if value is not None:
                argv += [flag, str(value)]
        return argv


def engine_command(args: EngineArgs, python: str | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """argv to start one engine with the given (or the running) interpreter; `extra_args` go last."""
    return [
        python or sys.executable,
        "-m",
        "pinned_eval.cli",
        "engine",
        "serve",
        *args.cli_args(),
        *extra_args,
    ]


class EngineStartError(RuntimeError):
    """An engine process died or did not become ready in time; the message has its log tail."""


@dataclass
class EngineProcess:
    """A running engine process started by `spawn_engine`."""

    args: EngineArgs
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.port}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.2) -> None:
        """Block until `GET /health_generate` answers 200."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise EngineStartError(
                        f"engine on port {self.args.port} exited with {code}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health_generate").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineStartError(
                        f"engine on port {self.args.port} not ready after {timeout:.0f}s:\n{self.log_tail()}"
                    )
                time.sleep(interval)

    def stop(self, grace: float = 10.0) -> int | None:
        """Terminate this PID (SIGTERM, SIGKILL after `grace` seconds); return the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=grace)
        return self.proc.returncode


def spawn_engine(
    args: EngineArgs,
    log_path: Path,
    python: str | None = None,
    env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> EngineProcess:
    """Start one engine process in the background (not waiting for readiness)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            engine_command(args, python, extra_args),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    return EngineProcess(args=args, proc=proc, log_path=log_path)
