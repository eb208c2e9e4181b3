"""A new user's first hour, through the real `pinned-eval` CLI (subprocesses) on a fresh home with
no Prefect variable exported: `server up` records the server in the home and every verb finds it
there; a request with a missing local path or unsaved blocks is refused with exit 2 before anything
is sent (no flow run, no event on the server); `server up` after `server down` comes back on the
same port. The home stays private (0700, credential 0600) and the credential is never printed."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.deploykit import REPO
from tests.prefect_server import prefect_rest_client

pytestmark = pytest.mark.e2e


def clean_env(home: Path) -> dict[str, str]:
    """The environment of a new user's shell: no Prefect or pinned-eval variable, only the home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PINNED_EVAL_"))}
    return dict(env, PINNED_EVAL_HOME=str(home))


def pinned_eval(home: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO, env=clean_env(home),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def fresh_home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home"
    try:
        yield home
    finally:
        down = pinned_eval(home, "server", "down")
        assert down.returncode == 0, down.stderr


def _ui_url(out: str) -> str:
    return re.search(r"Prefect UI: (http://127\.0\.0\.1:\d+)", out).group(1)  # type: ignore[union-attr]


@pytest.mark.timeout(900)  # eight CLI processes, each importing Prefect
def test_a_fresh_home_refuses_bad_requests_before_sending_and_keeps_its_server_port(
    fresh_home: Path, tmp_path: Path
):
    home = fresh_home
    up = pinned_eval(home, "server", "up", "--port", str(free_port()))  # not 4200: other test runs may want it
    assert up.returncode == 0, up.stderr
    ui = _ui_url(up.stdout)
    credential = (home / "api-auth").read_text().strip()
    assert credential not in up.stdout + up.stderr
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "api-auth").stat().st_mode) == 0o600

    missing = tmp_path / "ckpt" / "step_3"
    bad_path = pinned_eval(home, "request", "--run", "newbie", "--step", "3", "--source", f"hf:{missing}")
    assert (bad_path.returncode, bad_path.stderr.strip()) == (
        2, f"error: --source: {missing} does not exist; nothing was sent"
    )

    missing.mkdir(parents=True)
    no_blocks = pinned_eval(home, "request", "--run", "newbie", "--step", "3", "--source", f"hf:{missing}",
                            "--fleet", "gpu-node")
    assert (no_blocks.returncode, no_blocks.stderr.strip()) == (2, (
        "error: --suite: no pinned-eval-suite block named 'default'; --fleet: no pinned-eval-fleet block named "
        "'gpu-node'; --staging: no pinned-eval-staging block named 'default'; --sinks: no pinned-eval-sinks block "
        "named 'default'; nothing was sent. Save the blocks first (`pinned-eval block save --help`), or name saved ones"
    ))

    with prefect_rest_client(f"{ui}/api", headers={"Authorization": _basic(credential)}) as rest:
        runs = rest.post("/flow_runs/filter", json={"limit": 10})
        events = rest.post("/events/filter", json={"filter": {"event": {"prefix": ["pinned-eval."]}}, "limit": 10})
    assert runs.status_code == 200 and runs.json() == []
    assert events.status_code == 200 and events.json()["events"] == [], events.text

    # a read verb reaches the home's server with nothing exported: the run simply has no point
    status = pinned_eval(home, "status", "--run", "newbie")
    assert (status.returncode, status.stderr.strip()) == (1, "error: no eval point of run 'newbie' is recorded")

    down = pinned_eval(home, "server", "down")
    assert down.returncode == 0 and down.stdout.startswith("stopped: server "), down.stdout
    status = pinned_eval(home, "status", "--run", "newbie")
    assert status.returncode == 2 and status.stderr.startswith("error: no Prefect API: run `pinned-eval server up`")
    again = pinned_eval(home, "server", "up")
    assert again.returncode == 0, again.stderr
    assert _ui_url(again.stdout) == ui  # the recorded port, not a new one


def _basic(credential: str) -> str:
    import base64

    return "Basic " + base64.b64encode(credential.encode()).decode()
