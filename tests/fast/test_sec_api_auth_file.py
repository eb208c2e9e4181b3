"""Security: the Prefect API credential's file (`<home>/api-auth`) — generated at mode 0600 in a
0700 home, refused when others could read or swap it, and sent by the trainer side
(`PINNED_EVAL_API_AUTH_FILE`) as HTTP basic auth, never as a flow parameter."""

from __future__ import annotations

import base64
import os
import re
import stat
from pathlib import Path

import pytest

from app.prefect_server import ensure_auth_file, private_dir
from pinned_eval.events import BlockNames
from pinned_eval.settings import AUTH_FILE_ENV, PrefectApiSettings, read_auth_file
from tests.conftest import free_port
from tests.fast.test_eval_client import http_server, request  # noqa: F401 - fixture
from trainer_integration.client import EvalClient
from trainer_integration.events import Delivery, event_entry
from trainer_integration.rest import PrefectRest, api_client


@pytest.fixture(autouse=True)
def _no_inherited_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PREFECT_API_AUTH_STRING", "PREFECT_API_KEY", AUTH_FILE_ENV):
        monkeypatch.delenv(name, raising=False)


def test_the_credential_is_generated_once_at_0600_in_a_0700_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    assert private_dir(home) == home
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    first = ensure_auth_file(home / "api-auth")
    assert re.fullmatch(r"pinned-eval:[A-Za-z0-9_-]{43}", first), "256 random bits, url-safe"
    assert stat.S_IMODE((home / "api-auth").stat().st_mode) == 0o600
    assert ensure_auth_file(home / "api-auth") == first  # kept, not regenerated
    assert ensure_auth_file(tmp_path / "other") != first


def test_a_credential_file_others_could_read_or_swap_is_refused(tmp_path: Path) -> None:
    readable = tmp_path / "readable"
    readable.write_text("u:p\n")
    readable.chmod(0o644)
    with pytest.raises(PermissionError, match=str(readable)):
        read_auth_file(readable)
    real = tmp_path / "real"
    real.write_text("u:p\n")
    real.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP
        read_auth_file(link)
    with pytest.raises(PermissionError, match=str(readable)):
        ensure_auth_file(readable)
    assert read_auth_file(real).get_secret_value() == "u:p"
    empty = tmp_path / "empty"
    empty.touch(mode=0o600)
    with pytest.raises(ValueError, match="empty"):
        read_auth_file(empty)


def test_the_trainer_sends_the_credential_from_its_file_and_an_explicit_string_wins(
    http_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811 - fixture
) -> None:
    api, rec = http_server
    secret = ensure_auth_file(tmp_path / "api-auth")
    monkeypatch.setenv(AUTH_FILE_ENV, str(tmp_path / "api-auth"))
    Delivery(PrefectRest(api, api_client(PrefectApiSettings())))(event_entry(request(1), BlockNames()))
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "admin:explicit")
    Delivery(PrefectRest(api, api_client(PrefectApiSettings())))(event_entry(request(2), BlockNames()))
    from_file, explicit = (r["headers"]["Authorization"] for r in rec.requests)
    assert from_file == "Basic " + base64.b64encode(secret.encode()).decode()
    assert explicit == "Basic " + base64.b64encode(b"admin:explicit").decode()
    assert all(secret not in str(r["json"]) for r in rec.requests), "never in the request body (parameters)"


def test_eval_client_reads_the_credential_file_named_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = ensure_auth_file(tmp_path / "api-auth")
    monkeypatch.setenv(AUTH_FILE_ENV, str(tmp_path / "api-auth"))
    dead = f"http://127.0.0.1:{free_port()}/api"
    with EvalClient("exp42", dead, spool_dir=tmp_path / "spool", startup_sync_s=0) as client:
        assert client.rest.http.headers["Authorization"] == "Basic " + base64.b64encode(secret.encode()).decode()
    os.chmod(tmp_path / "api-auth", 0o640)
    with pytest.raises(PermissionError, match="api-auth"):
        EvalClient("exp42", dead, spool_dir=tmp_path / "spool2")
