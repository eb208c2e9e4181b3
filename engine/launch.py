"""The engine's startup configuration (`EngineArgs`), validated from `python -m engine` flags.

Launching is not done here: `engine` imports nothing of the project, and the project's launchers
(`pinned_eval.fleet.cpu_engine`) build the `python -m engine ...` command line themselves, as a
list of strings; a fast test keeps their `CpuEngineArgs` in step with this model.
This module imports no torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Where the engine reads its keys (the launcher never puts them on the command line).
API_KEY_ENV = "PINNED_EVAL_ENGINE_API_KEY"
ADMIN_API_KEY_ENV = "PINNED_EVAL_ENGINE_ADMIN_API_KEY"


class EngineArgs(BaseModel):
    """Startup configuration of one CPU engine (mirrors the SGLang ServerArgs it needs)."""

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
    # SGLang's `--tool-call-parser` for /v1/chat/completions (engine/tool_calls.py); None: tool
    # calls stay in the message content.
    tool_call_parser: Literal["qwen25", "hermes"] | None = None
    # Tests only: a JSON rules file of prompt substring -> completion (engine/scripted.py).
    scripted_completions: str | None = None
