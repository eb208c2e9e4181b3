"""The bundled CPU engine as a process: its command line, spawn, readiness wait and stop.

`engine` is a leaf package: nothing here imports it. Contract:
- `CpuEngineArgs` mirrors the flags of `python -m engine` (`engine.cli.serve`; a fast test keeps
  the two in step) and `engine_command` returns that argv for the running (or given) interpreter,
  so a child uses the same virtualenv; `extra_args` go last (a key flag there is refused).
- Keys never go on the command line (any local user reads it in `ps`): `engine_env` hands them
  over in the engine's environment (`fleet.keys.ENGINE_*_ENV`), which only its own user can read.
- `spawn_engine(args, log_path)` starts it through the process manager (own process group,
  stdout+stderr appended to `log_path`); `EngineProcess.wait_ready(timeout)` polls
  `GET /health_generate` until 200 and raises `LaunchError` (with the log tail) if the process
  exits or the deadline passes; `EngineProcess.stop()` stops its process group (TERM, then KILL).
This module imports no torch, so launchers stay light.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pinned_eval.fleet.keys import (
    ENGINE_ADMIN_API_KEY_ENV,
    ENGINE_API_KEY_ENV,
    refuse_key_flags,
    scrubbed_launch_errors,
)
from pinned_eval.processes import ProcessRecord, ProcessSpec, start_process, stop_process, wait_http_ok


class CpuEngineArgs(BaseModel):
    """Startup configuration of one CPU engine, as `python -m engine` flags."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str
    port: int = Field(ge=1, le=65535)
    host: str = "127.0.0.1"
    weight_version: str = "default"
    served_model_name: str | None = None
    api_key: str | None = Field(default=None, repr=False)
    admin_api_key: str | None = Field(default=None, repr=False)
    threads: int = Field(default=1, ge=1)
    max_batch_size: int = Field(default=64, ge=1)
    context_length: int | None = Field(default=None, ge=2)
    health_timeout_s: float = Field(default=20.0, gt=0)
    tool_call_parser: Literal["qwen25", "hermes"] | None = Field(
        default=None, description="SGLang's --tool-call-parser for /v1/chat/completions (None: calls stay text)."
    )
    scripted_completions: str | None = Field(
        default=None, description="Tests only: the engine's --scripted-completions rules file."
    )

    def cli_args(self) -> list[str]:
        """The `python -m engine` flags that reproduce these args, keys excepted (see `engine_env`)."""
        argv = ["--model-path", self.model_path, "--port", str(self.port), "--host", self.host]
        argv += ["--weight-version", self.weight_version, "--threads", str(self.threads)]
        argv += ["--max-batch-size", str(self.max_batch_size), "--health-timeout", str(self.health_timeout_s)]
        optional = {
            "--served-model-name": self.served_model_name,
            "--context-length": self.context_length,
            "--tool-call-parser": self.tool_call_parser,
            "--scripted-completions": self.scripted_completions,
        }
        for flag, value in optional.items():
            if value is not None:
                argv += [flag, str(value)]
        return argv


def engine_command(args: CpuEngineArgs, python: str | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """argv to start one engine with the given (or the running) interpreter; `extra_args` go last."""
    refuse_key_flags(extra_args, "extra_args")
    return [python or sys.executable, "-m", "engine", *args.cli_args(), *extra_args]


def engine_env(args: CpuEngineArgs) -> dict[str, str]:
    """The environment entries that give the engine its keys."""
    keys = {ENGINE_API_KEY_ENV: args.api_key, ENGINE_ADMIN_API_KEY_ENV: args.admin_api_key}
    return {k: v for k, v in keys.items() if v}


def engine_spec(
    args: CpuEngineArgs, *, python: str | None = None, extra_args: Sequence[str] = (), env: dict[str, str] | None = None
) -> ProcessSpec:
    """The process-manager spec of one engine (its /health_generate is the readiness probe)."""
    return ProcessSpec(
        role="engine",
        command=engine_command(args, python, extra_args),
        env={**(env or {}), **engine_env(args)},
        port=args.port,
        host=args.host,
        health_path="/health_generate",
    )


@dataclass
class EngineProcess:
    """A running engine process started by `spawn_engine`."""

    args: CpuEngineArgs
    record: ProcessRecord
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return self.record.url

    @property
    def log_path(self) -> Path:
        return Path(self.record.log_path)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until `GET /health_generate` answers 200 (`LaunchError` on exit or timeout)."""
        with scrubbed_launch_errors([self.args.api_key, self.args.admin_api_key]):
            wait_http_ok(self.record, timeout_s=timeout, popen=self.proc)

    def stop(self, grace: float = 10.0) -> int | None:
        """Stop the engine's process group (SIGTERM, SIGKILL after `grace` seconds); return the exit code."""
        stop_process(self.record, grace_s=grace)
        return self.proc.wait(timeout=grace)


def spawn_engine(
    args: CpuEngineArgs,
    log_path: Path,
    python: str | None = None,
    env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> EngineProcess:
    """Start one engine process in the background (not waiting for readiness)."""
    record, proc = start_process(engine_spec(args, python=python, extra_args=extra_args, env=env), Path(log_path))
    return EngineProcess(args=args, record=record, proc=proc)
