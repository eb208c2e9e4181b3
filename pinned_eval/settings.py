"""The one place pinned-eval reads its environment (prefix `PINNED_EVAL_`).

Prefect's own settings (`PREFECT_API_URL`, ...) stay Prefect's; this object holds only ours.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PINNED_EVAL_", extra="ignore")

    home: Path = Field(
        default=Path(".pinned-eval"),
        description="State directory: PID files, logs, local Prefect home, tiny models, staging.",
    )
    load_timeout_s: float = Field(default=600.0, gt=0, description="Timeout of one weight load on one engine.")
    demo_hold: bool = Field(
        default=False, description="Keep the demo's services up after the table until SIGINT/SIGTERM, terminal or not."
    )


def get_settings() -> Settings:
    return Settings()


class PrefectApiSettings(BaseSettings):
    """How the trainer side reaches Prefect without importing it: Prefect's own variable names.

    `PREFECT_API_URL`; auth is `PREFECT_API_AUTH_STRING` (`user:pass`, HTTP basic, a self-hosted
    server with `PREFECT_SERVER_API_AUTH_STRING`) or else `PREFECT_API_KEY` (Bearer, Prefect
    Cloud) — the same precedence as Prefect's client. `PINNED_EVAL_WEBHOOK_URL` sends point
    requests to a Prefect Cloud webhook instead of `POST /api/events`.
    """

    model_config = SettingsConfigDict(extra="ignore")

    api_url: str | None = Field(default=None, validation_alias="PREFECT_API_URL")
    api_key: SecretStr | None = Field(default=None, validation_alias="PREFECT_API_KEY")
    api_auth_string: SecretStr | None = Field(default=None, validation_alias="PREFECT_API_AUTH_STRING")
    webhook_url: str | None = Field(default=None, validation_alias="PINNED_EVAL_WEBHOOK_URL")
