"""Engine and router keys: generated when none is configured, handed over by environment or a 0600
file (never argv), and scrubbed from every text that leaves a launcher.

Contract:
- `FleetKeys.resolve(api_key, admin_api_key)` fills a missing key with `secrets.token_hex(32)`
  (256 bits; hex, so a key never starts with '-': SGLang merges its `--config` file into argv,
  where `--api-key -x...` would read as a missing value):
  every engine pinned-eval launches has both. The API key guards the data plane (and the router),
  the admin key the control plane (`/update_weights_from_disk`, ...): SGLang's rules.
- The bundled CPU engine reads `ENGINE_API_KEY_ENV` / `ENGINE_ADMIN_API_KEY_ENV` (typer envvar on
  `python -m engine`); real SGLang reads a 0600 YAML `--config` file (`write_sglang_key_config`:
  SGLang merges it into its args in-process, so only the path is on the command line); the
  router wrapper (`pinned_eval.fleet.router_main`) reads `ROUTER_API_KEY_ENV`. A process's
  environment (`/proc/<pid>/environ`) is readable by its own user only.
- `private_dir` / `private_file`: a directory of ours, mode 0700 (created if missing); a file of
  ours, mode 0600, never through a symlink. Logs, key files and the fleet state file live there.
- `scrub(text, secrets)` replaces every given secret and anything shaped like a key flag,
  `api_key=...` assignment or bearer token with `<redacted>`; `scrubbed_launch_errors` applies it
  to every `LaunchError` (which carries log tails) before it leaves a launcher and becomes CLI
  output, a crash message or a skip message.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, ConfigDict, SecretStr, field_serializer

from pinned_eval.durable import replace_durably
from pinned_eval.processes import LaunchError

ENGINE_API_KEY_ENV = "PINNED_EVAL_ENGINE_API_KEY"
ENGINE_ADMIN_API_KEY_ENV = "PINNED_EVAL_ENGINE_ADMIN_API_KEY"
ROUTER_API_KEY_ENV = "PINNED_EVAL_ROUTER_API_KEY"
KEY_FLAGS = ("--api-key", "--admin-api-key", "--config", "--control-plane-api-keys")
REDACTED = "<redacted>"

_PATTERNS = (
    re.compile(r"(?i)(--(?:admin-)?api-key[= ]+)(\S+)"),
    re.compile(r"(?i)((?:admin_)?api_key['\"]?\s*[=:]\s*['\"]?)([^'\",\s)]+)"),
    re.compile(r"(?i)(bearer\s+)([A-Za-z0-9._~+/=-]+)"),
)


def new_key() -> str:
    return secrets.token_hex(32)


class FleetKeys(BaseModel):
    """The two bearer keys of a launched fleet (the same on every engine; the router has the API key)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_key: SecretStr
    admin_api_key: SecretStr

    @classmethod
    def resolve(cls, api_key: str | None = None, admin_api_key: str | None = None) -> FleetKeys:
        """The configured keys; a missing one is generated."""
        return cls(api_key=SecretStr(api_key or new_key()), admin_api_key=SecretStr(admin_api_key or new_key()))

    @field_serializer("api_key", "admin_api_key", when_used="json")
    def _reveal(self, value: SecretStr) -> str:  # only the 0600 state file is written as JSON
        return value.get_secret_value()

    @property
    def api(self) -> str:
        return self.api_key.get_secret_value()

    @property
    def admin(self) -> str:
        return self.admin_api_key.get_secret_value()

    def values(self) -> list[str]:
        return [self.api, self.admin]

    def engine_env(self) -> dict[str, str]:
        """What the CPU engine reads its keys from."""
        return {ENGINE_API_KEY_ENV: self.api, ENGINE_ADMIN_API_KEY_ENV: self.admin}


def scrub(text: str, known: Iterable[str | None] = ()) -> str:
    """`text` with every secret in `known` and every key-shaped token replaced by `<redacted>`."""
    for value in sorted({k for k in known if k}, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + REDACTED, text)
    return text


@contextmanager
def scrubbed_launch_errors(known: Iterable[str | None]) -> Iterator[None]:
    """Re-raise a `LaunchError` (log tails included) with `known` secrets and key shapes scrubbed
    from its message (the same exception, its text replaced: no unscrubbed copy stays chained)."""
    try:
        yield
    except LaunchError as exc:
        exc.args = (scrub(str(exc), known),)
        raise


def refuse_key_flags(argv: Iterable[str], field: str) -> None:
    """`ValueError` naming `field` when `argv` carries a key on the command line."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in KEY_FLAGS:
            raise ValueError(f"{field}: {flag} puts a key on the command line (visible in ps); configure keys "
                             "on the fleet/backend (api_key, admin_api_key) instead")


def private_dir(path: Path) -> Path:
    """`path` as a directory of this user with mode 0700 (created if missing). A shared sticky
    directory (like /tmp) is left as it is: the files under it protect themselves."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path}: not a directory (a symlink?); refusing to keep keys or logs there")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path}: owned by uid {st.st_uid}, not by this user; refusing to keep keys there")
    if not st.st_mode & stat.S_ISVTX and stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def private_file(path: Path) -> Path:
    """Create `path` (or keep it) as a regular file of this user with mode 0600; never follows a symlink."""
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{path}: owned by uid {st.st_uid}, not by this user")
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return path


def write_private(path: Path, text: str) -> None:
    """Atomically replace `path` with `text`, mode 0600 in a 0700 directory (never through a symlink)."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    replace_durably(tmp, path)


def write_sglang_key_config(path: Path, keys: FleetKeys) -> Path:
    """SGLang's `--config` YAML holding only the two keys (0600); `path` must end in .yaml."""
    if path.suffix not in (".yaml", ".yml"):
        raise ValueError(f"{path}: SGLang reads --config files ending in .yaml or .yml only")
    write_private(path, f"api-key: {json.dumps(keys.api)}\nadmin-api-key: {json.dumps(keys.admin)}\n")
    return path
