"""Engine keys against a hostile local user (`pe-neighbour`, tests/neighbour.py).

Every engine and router pinned-eval launches has an API key and an admin key (generated when none
is configured), handed over by environment or a 0600 file, never on the command line; logs and the
state file are 0600 in 0700 directories; launch errors carry no key. The fleets' runtime paths lie
under the world-traversable `shared_dir`, so what refuses the neighbour is the product's own modes.
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
import pytest

from pinned_eval.fleet.launcher import LaunchedFleet, launch_cpu_fleet
from pinned_eval.processes import LaunchError
from tests.neighbour import Neighbour, run_as

pytestmark = pytest.mark.e2e

READ_CMDLINE = """
import sys
for pid in sys.argv[1:]:
    print(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
"""

TRY_READ = """
import os, sys
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").read()
        print("READ", path)
    except PermissionError:
        print("DENIED", path)
"""

POST = """
import json, sys, urllib.error, urllib.request
url, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
try:
    print(urllib.request.urlopen(req, timeout=30).status)
except urllib.error.HTTPError as err:
    print(err.code)
"""


@pytest.fixture(scope="module")
def keyed_fleet(tiny_model_dir: Path, neighbour: Neighbour) -> Iterator[tuple[LaunchedFleet, Path, str, str]]:
    """One engine + router launched with configured keys, its state and logs under a shared dir."""
    shared = Path(f"/tmp/pe-shared-keys-{uuid.uuid4().hex[:8]}")
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    api_key, admin_key = f"sk-data-{uuid.uuid4().hex}", f"sk-admin-{uuid.uuid4().hex}"
    fleet = launch_cpu_fleet(tiny_model_dir, 1, state_file=shared / "fleet" / "fleet.json", api_key=api_key,
                             admin_api_key=admin_key, weight_version="5", ready_timeout_s=180)
    try:
        yield fleet, shared, api_key, admin_key
    finally:
        fleet.stop()
        subprocess.run(["rm", "-rf", str(shared)], check=True)


def test_neighbour_sees_no_key_on_engine_or_router_command_lines(keyed_fleet, neighbour: Neighbour) -> None:  # type: ignore[no-untyped-def]
    fleet, _shared, api_key, admin_key = keyed_fleet
    assert fleet.state.router is not None
    pids = [str(fleet.pid_of(u)) for u in fleet.engine_urls] + [str(fleet.state.router.pid)]
    seen = run_as(neighbour, READ_CMDLINE, *pids)
    assert seen.returncode == 0, seen.stderr
    lines = seen.stdout.splitlines()
    assert len(lines) == 2 and "engine" in lines[0] and "router" in lines[1], lines
    for line in lines:
        assert api_key not in line and admin_key not in line, line
        assert "--api-key" not in line and "--admin-api-key" not in line, line
    environ = run_as(neighbour, "import sys; open(f'/proc/{sys.argv[1]}/environ', 'rb').read()", pids[0])
    assert environ.returncode != 0 and "PermissionError" in environ.stderr, "the environment holds the keys"


def test_neighbour_cannot_read_logs_or_state_and_no_log_holds_a_key(keyed_fleet, neighbour: Neighbour) -> None:  # type: ignore[no-untyped-def]
    fleet, shared, api_key, admin_key = keyed_fleet
    state_file, log_dir = Path(fleet.state_file), Path(fleet.state.log_dir)
    logs = sorted(log_dir.glob("*.log"))
    assert [p.name.split("-")[0] for p in logs] == ["engine", "router"]
    for path in (state_file, *logs):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for path in (state_file.parent, log_dir):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for log in logs:
        text = log.read_text(errors="replace")
        assert api_key not in text and admin_key not in text, log
    tried = run_as(neighbour, TRY_READ, str(state_file), str(log_dir), *map(str, logs))
    assert tried.returncode == 0, tried.stderr
    assert [line.split()[0] for line in tried.stdout.splitlines()] == ["DENIED"] * (2 + len(logs)), tried.stdout
    assert shared.stat().st_mode & 0o777 == 0o777  # the parent let everyone in: the product's modes refused


def test_fleet_up_without_keys_refuses_a_neighbours_weight_swap(
    tiny_model_dir: Path, neighbour: Neighbour, shared_dir: Path
) -> None:
    """`pinned-eval fleet up` (no key configured) generates keys: the neighbour's POST
    /update_weights_from_disk (and /update_weight_version, and a router worker of its own) is 401
    and the pinned version stays."""
    state = shared_dir / "cli" / "fleet.json"
    cli = [sys.executable, "-m", "app.cli", "fleet"]
    up = subprocess.run([*cli, "up", "--engines", "1", "--model-path", str(tiny_model_dir), "--weight-version", "9",
                         "--state-file", str(state)], capture_output=True, text=True, timeout=240)
    try:
        assert up.returncode == 0, up.stderr
        lines = dict(line.split(" ", 1) for line in up.stdout.splitlines())
        engine, router = lines["engine"], lines["router"]
        swap = json.dumps({"model_path": str(tiny_model_dir), "weight_version": "evil"})
        attacks = {
            f"{engine}/update_weights_from_disk": swap,
            f"{engine}/update_weight_version": json.dumps({"new_version": "evil"}),
            f"{router}/workers": json.dumps({"url": "http://127.0.0.1:9"}),
        }
        for url, body in attacks.items():
            got = run_as(neighbour, POST, url, body)
            assert got.stdout.strip() == "401", (url, got.stdout, got.stderr)
        keys = LaunchedFleet.load(state).keys
        assert keys is not None
        with httpx.Client(headers={"Authorization": f"Bearer {keys.api}"}, timeout=30) as http:
            assert http.get(f"{engine}/model_info").json()["weight_version"] == "9"
            assert [w["url"] for w in http.get(f"{router}/workers").json()["workers"]] == [engine]
    finally:
        down = subprocess.run([*cli, "down", "--state-file", str(state)], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr


def test_reference_backend_launch_has_keys(tiny_model_dir: Path, neighbour: Neighbour, shared_dir: Path) -> None:
    """The reference backend's launched server (no key configured) refuses the neighbour's swap."""
    from trainer_integration.sglang_backend import SGLangCheckpointEval

    backend = SGLangCheckpointEval(launch="cpu", model_path=str(tiny_model_dir), log_dir=str(shared_dir / "ext"))
    try:
        assert backend.launched is not None
        with httpx.Client(timeout=10) as http:
            from pinned_eval.polling import poll_until

            def up() -> bool:
                try:
                    return http.get(f"{backend.url}/health").status_code == 200
                except httpx.TransportError:
                    return False

            poll_until(up, timeout_s=180, what=f"{backend.url} healthy")
        swap = json.dumps({"model_path": str(tiny_model_dir), "weight_version": "evil"})
        got = run_as(neighbour, POST, f"{backend.url}/update_weights_from_disk", swap)
        assert got.stdout.strip() == "401", got.stdout + got.stderr
        cmdline = run_as(neighbour, READ_CMDLINE, str(backend.launched.pid))
        assert "--api-key" not in cmdline.stdout and "--admin-api-key" not in cmdline.stdout
        log = Path(backend.launched.log_path)
        assert stat.S_IMODE(log.stat().st_mode) == 0o600 and stat.S_IMODE(log.parent.stat().st_mode) == 0o700
    finally:
        backend.dispose()


def test_launch_failure_message_carries_no_key(tmp_path: Path, neighbour: Neighbour, shared_dir: Path) -> None:
    """An engine that exits at boot: the LaunchError (with its log tail) names no key."""
    not_a_model = tmp_path / "not-a-model"
    not_a_model.write_text("x")
    api_key, admin_key = f"sk-data-{uuid.uuid4().hex}", f"sk-admin-{uuid.uuid4().hex}"
    with pytest.raises(LaunchError) as err:
        launch_cpu_fleet(not_a_model, 1, state_file=shared_dir / "bad" / "fleet.json", api_key=api_key,
                         admin_api_key=admin_key, ready_timeout_s=120)
    text = str(err.value)
    assert "exited before it was healthy" in text and "is not a directory" in text, text
    chain = [err.value, err.value.__cause__, err.value.__context__]
    for exc in (e for e in chain if e is not None):
        assert api_key not in str(exc) and admin_key not in str(exc), str(exc)
    assert os.environ.get("PINNED_EVAL_ENGINE_API_KEY") != api_key  # the launcher's own env is untouched


def test_sglang_launch_mode_gets_keys_by_config_file(
    tiny_model_dir: Path, neighbour: Neighbour, shared_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`launch_sglang_fleet` with no key configured, through a GPU-free `sglang.launch_server`
    (tests/fake_sglang: SGLang's `--config` merge, then the CPU engine in-process): the engine
    has generated keys, its command line only the 0600 key file's path, and the neighbour's
    weight swap is 401."""
    from pinned_eval.fleet.launcher import launch_sglang_fleet
    from pinned_eval.fleet.sglang_args import SGLangFleetSpec

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(repo / "tests" / "fake_sglang"), str(repo)]))
    spec = SGLangFleetSpec(model_path=str(tiny_model_dir), num_gpus=1, weight_version="3")
    root = shared_dir / "sglang-fleet"
    fleet = launch_sglang_fleet(spec, log_dir=root / "logs", state_file=root / "fleet.json", ready_timeout_s=180)
    try:
        [engine] = fleet.engine_urls
        cmdline = run_as(neighbour, READ_CMDLINE, str(fleet.pid_of(engine))).stdout
        assert "sglang.launch_server" in cmdline and "--config" in cmdline, cmdline
        assert "--api-key" not in cmdline and "--admin-api-key" not in cmdline, cmdline
        key_file = cmdline.split("--config ", 1)[1].split()[0]
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        assert run_as(neighbour, TRY_READ, key_file).stdout.split()[0] == "DENIED"
        swap = json.dumps({"model_path": str(tiny_model_dir), "weight_version": "evil"})
        got = run_as(neighbour, POST, f"{engine}/update_weights_from_disk", swap)
        assert got.stdout.strip() == "401", got.stdout + got.stderr
        assert fleet.keys is not None
        info = httpx.get(f"{engine}/model_info", headers={"Authorization": f"Bearer {fleet.keys.api}"}, timeout=30)
        assert info.json()["weight_version"] == "3"
    finally:
        fleet.stop()
    assert not Path(key_file).exists(), "stop() removes the key file"
