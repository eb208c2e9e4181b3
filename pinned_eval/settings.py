"""The one place pinned-eval reads its environment (prefix `PINNED_EVAL_`).

Prefect's own settings (`PREFECT_API_URL`, ...) stay Prefect's; this object holds only ours.
"""

from __future__ import annotations

import base64
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

# the variable naming a file that holds the Prefect API credential (`user:password`, one line)
AUTH_FILE_ENV = "PINNED_EVAL_API_AUTH_FILE"
# the credential's file name in a pinned-eval home (`pinned-eval server up`, the stack, the demo)
AUTH_FILE_NAME = "api-auth"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PINNED_EVAL_", extra="ignore")

    home: Path = Field(
        default=Path(".pinned-eval"),
        description="The one home of every verb (mode 0700): the server's address and port (stack.json), its "
        "API credential (api-auth), PID files, logs, the local Prefect home and database, the demo's files (demo/).",
    )
    load_timeout_s: float = Field(default=600.0, gt=0, description="Timeout of one weight load on one engine.")
    demo_hold: bool = Field(
        default=False, description="Keep the demo's services up after the table until SIGINT/SIGTERM, terminal or not."
    )


def get_settings() -> Settings:
    return Settings()


def read_auth_file(path: Path) -> SecretStr:
    """The API credential stored at `path` (its one line, `user:password`).

    Like an SSH key, the file must be a regular file (not a symlink) with no permission bits for
    group or others (mode 0600): anything else raises `PermissionError` naming the path, so a
    credential a neighbour could read or swap is never used. An empty file raises `ValueError`.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise PermissionError(f"{path}: the API credential file must be a regular file of mode 0600, "
                                  f"not {stat.filemode(st.st_mode)}")
        text = os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)
    if not text:
        raise ValueError(f"{path}: the API credential file is empty")
    return SecretStr(text)


class PrefectApiSettings(BaseSettings):
    """How the trainer side reaches Prefect without importing it: Prefect's own variable names.

    `PREFECT_API_URL`; auth is `PREFECT_API_AUTH_STRING` (`user:pass`, HTTP basic, a self-hosted
    server with `PREFECT_SERVER_API_AUTH_STRING`), else the file named by
    `PINNED_EVAL_API_AUTH_FILE` (e.g. `<home>/api-auth`, written by `pinned-eval server up`; read
    once, at construction, by `read_auth_file`), else `PREFECT_API_KEY` (Bearer, Prefect Cloud) —
    the same precedence as Prefect's client. The credential is never a flow parameter.
    `PINNED_EVAL_WEBHOOK_URL` sends point requests to a Prefect Cloud webhook instead of
    `POST /api/events`.
    """

    model_config = SettingsConfigDict(extra="ignore")

    api_url: str | None = Field(default=None, validation_alias="PREFECT_API_URL")
    api_key: SecretStr | None = Field(default=None, validation_alias="PREFECT_API_KEY")
    api_auth_string: SecretStr | None = Field(default=None, validation_alias="PREFECT_API_AUTH_STRING")
    api_auth_file: Path | None = Field(default=None, validation_alias=AUTH_FILE_ENV)
    webhook_url: str | None = Field(default=None, validation_alias="PINNED_EVAL_WEBHOOK_URL")

    @model_validator(mode="after")
    def _auth_from_file(self) -> PrefectApiSettings:
        if self.api_auth_string is None and self.api_auth_file is not None:
            self.api_auth_string = read_auth_file(self.api_auth_file)
        return self

    def auth_headers(self) -> dict[str, str]:
        """The Authorization header: basic auth string, else Bearer API key, else none."""
        if self.api_auth_string is not None:
            token = base64.b64encode(self.api_auth_string.get_secret_value().encode()).decode()
            return {"Authorization": f"Basic {token}"}
        if self.api_key is not None:
            return {"Authorization": f"Bearer {self.api_key.get_secret_value()}"}
        return {}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> PrefectApiSettings:
        """The settings `environ` holds, and nothing of the process's environment (a caller that
        passes its own environment means exactly that one)."""
        aliases = {str(f.validation_alias) for f in cls.model_fields.values()}
        return _ExplicitPrefectApi.model_validate({k: v for k, v in environ.items() if k in aliases})


class _ExplicitPrefectApi(PrefectApiSettings):
    """`PrefectApiSettings` from its keyword arguments only."""

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource, *_: Any, **__: Any
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)
