"""Security: `pinned-eval server up` starts an authenticated Prefect API, and a neighbour on the
node (another local user, `pe-neighbour`) can neither use the API nor read the credential.

The stack's home lies in a world-traversable directory (`shared_dir`, 1777), so what refuses the
neighbour is the product's own controls: the API's auth string (401 on everything but the health
probe), the home's mode 0700 and the credential file's 0600. The operator's verbs (`deploy`,
`status`) find the server and the credential in the home, with nothing exported.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from pinned_eval.processes import stop_groups
from tests.conftest import free_port
from tests.neighbour import Neighbour, run_as

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
# what a neighbour tries, with the stdlib only: each request's HTTP status, printed as JSON
_ATTACK = r"""
import json, sys, urllib.error, urllib.request
api = sys.argv[1]
def call(method, path, body=None):
    req = urllib.request.Request(api + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
def status(method, path, body=None):
    return call(method, path, body)[0]
found, dep = call("GET", "/deployments/name/eval-point/eval-point")
dep_id = dep["id"] if found == 200 else "00000000-0000-4000-8000-000000000002"
event = {"id": "00000000-0000-4000-8000-000000000001", "occurred": "2026-01-01T00:00:00Z",
         "event": "pinned-eval.point.requested", "resource": {"prefect.resource.id": "pinned-eval.run.x"},
         "payload": {"run": "x", "step": 1}}
point = {"run": "x", "step": 1}
print(json.dumps({
    "health": status("GET", "/health"),
    "block secrets": status("POST", "/block_documents/filter", {"include_secrets": True}),
    "deployment": found,
    "create flow run": status("POST", f"/deployments/{dep_id}/create_flow_run", {"parameters": point}),
    "new flow": status("POST", "/flows/", {"name": "neighbour"}),
    "post events": status("POST", "/events", [event]),
    "variables": status("POST", "/variables/filter", {}),
}))
"""
_READ = r"""
import json, os, sys
out = {}
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as f:
            f.read(1)
        out[path] = "read"
    except OSError as exc:
        out[path] = type(exc).__name__
try:
    os.listdir(os.path.dirname(sys.argv[1]))
    out["listdir"] = "listed"
except OSError as exc:
    out["listdir"] = type(exc).__name__
print(json.dumps(out))
"""


def _cli(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`pinned-eval ARGS` with the home only: no Prefect URL or credential in the environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PINNED_EVAL_API_AUTH_FILE")}
    env.update(PINNED_EVAL_HOME=str(home), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def served_home(shared_dir: Path) -> Iterator[tuple[Path, str]]:
    """`pinned-eval server up` on a free port, its home under the world-traversable `shared_dir`;
    yields the home and what `server up` printed."""
    home = shared_dir / "home"
    up = _cli(home, "server", "up", "--port", str(free_port()))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield home, up.stdout + up.stderr
    finally:
        down = _cli(home, "server", "down")
        state = home / "stack.json"
        pids = [p for p in json.loads(state.read_text()).values() if isinstance(p, int)] if state.exists() else []
        stop_groups(pids, grace_s=30)  # whatever `server down` could not stop
        assert down.returncode == 0, down.stdout + down.stderr


def test_a_neighbour_gets_401_from_the_api_and_cannot_read_the_credential(
    neighbour: Neighbour, served_home: tuple[Path, str]
) -> None:
    home, printed = served_home
    api = json.loads((home / "stack.json").read_text())["api_url"]
    deploy = _cli(home, "deploy")  # finds the server and the credential in the home
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr

    attack = run_as(neighbour, _ATTACK, api)
    assert attack.returncode == 0, attack.stderr
    assert json.loads(attack.stdout) == {
        "health": 200,  # reachable: what refuses the rest is the auth string
        "block secrets": 401, "deployment": 401, "create flow run": 401, "new flow": 401, "post events": 401,
        "variables": 401,
    }

    auth_file = home / "api-auth"
    files = [str(auth_file), str(home / "prefect" / "prefect.db"), str(home / "prefect" / "server.log")]
    assert all(Path(f).exists() for f in files), files
    read = run_as(neighbour, _READ, *files)
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout) == {**dict.fromkeys(files, "PermissionError"), "listdir": "PermissionError"}
    assert stat.S_IMODE(auth_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700

    secret = auth_file.read_text().strip()
    with httpx.Client(base_url=api, auth=tuple(secret.split(":", 1)), timeout=30) as owner:  # type: ignore[arg-type]
        assert owner.post("/block_documents/filter", json={"include_secrets": True}).status_code == 200
    with httpx.Client(base_url=api, timeout=30) as anonymous:
        assert anonymous.post("/flow_runs/filter", json={}).status_code == 401
    ui = httpx.get(api.removesuffix("/api") + "/ui-settings", timeout=30).json()
    assert ui["auth"] == "BASIC", ui  # the UI asks for the credential (its login form)

    status = _cli(home, "status", "--run", f"nobody-{uuid.uuid4().hex[:6]}")
    assert status.returncode == 1, status.stdout + status.stderr  # reached the API: the run has no points
    assert "no eval point of run" in status.stderr, status.stderr
    leaked = [p.pid for p in psutil.process_iter(["cmdline"]) if secret in " ".join(p.info["cmdline"] or [])]
    assert not leaked, f"the credential is on the command line of {leaked}"
    assert str(auth_file.resolve()) in printed and secret not in printed, printed  # its path, never its value
    for log in home.rglob("*.log"):
        assert secret not in log.read_text(errors="replace"), f"the credential is in {log}"


def test_the_suite_runs_against_an_authenticated_server(prefect_server: str) -> None:
    """The session server every other test uses requires the credential too (so the whole suite
    proves the product works with auth on); the harness's clients send it."""
    from tests.prefect_server import prefect_rest_client

    assert httpx.post(f"{prefect_server}/flow_runs/filter", json={}, timeout=30).status_code == 401
    assert os.environ["PREFECT_API_AUTH_STRING"], "subprocesses inherit the credential"
    with prefect_rest_client(prefect_server) as http:
        assert http.post("/flow_runs/filter", json={"limit": 1}).status_code == 200
