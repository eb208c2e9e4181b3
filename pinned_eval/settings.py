"""The one place pinned-eval reads its environment (prefix `PINNED_EVAL_`).

Prefect's own settings (`PREFECT_API_URL`, ...) stay Prefect's; this object holds only ours.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PINNED_EVAL_", extra="ignore")

    home: Path = Field(
        default=Path(".pinned-eval"),
        description="State directory: PID files, logs, local Prefect home, tiny models, staging.",
    )
    load_timeout_s: float = Field(default=600.0, gt=0, description="Timeout of one weight load on one engine.")


def get_settings() -> Settings:
    return Settings()
