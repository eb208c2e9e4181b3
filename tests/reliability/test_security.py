"""Security: Prefect API auth through every client, secrets kept out of parameters/logs/artifacts,
SGLang-style bearer tokens on the engines' control plane, loopback binding by default.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from pydantic import SecretStr

from app.prefect_server import free_port, server_env, start_server, stop_server
from blocks import FleetBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.fleet.launcher import LaunchedFleet, launch_cpu_fleet
from pinned_eval.settings import PrefectApiSettings
from pinned_eval.sinks import JsonlSink
from pinned_eval.snapshot.staging import Staging
from tests.pointkit import CpuFleet, save_point_blocks, write_step_snapshot
from tests.prefect_server import prefect_rest_client
from tests.s3_fixtures import KEY, S3Server
from trainer_integration.rest import PrefectRest, api_client

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
AUTH = "pe-admin:pw-" + uuid.uuid4().hex[:10]


# ---- engines: bearer tokens on the control and data planes --------------------------------------


@pytest.fixture(scope="module")
def auth_fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LaunchedFleet, str, str]]:
    api_key, admin_key = f"sk-data-{uuid.uuid4().hex}", f"sk-admin-{uuid.uuid4().hex}"
    state = tmp_path_factory.mktemp("auth-fleet") / "fleet.json"
    fleet = launch_cpu_fleet(tiny_model, 1, state_file=state, api_key=api_key, admin_api_key=admin_key,
                             ready_timeout_s=180)
    try:
        yield fleet, api_key, admin_key
    finally:
        fleet.stop()


def test_engine_refuses_control_calls_without_the_admin_token(auth_fleet, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    fleet, api_key, _admin_key = auth_fleet
    [url] = fleet.engine_urls
    load = {"model_path": str(tiny_model), "weight_version": "evil"}
    with httpx.Client(timeout=60) as http:
        for headers in ({}, {"Authorization": f"Bearer {api_key}"}, {"Authorization": "Bearer wrong"}):
            assert http.post(f"{url}/update_weights_from_disk", json=load, headers=headers).status_code == 401
            assert http.post(f"{url}/update_weight_version", json={"new_version": "evil"},
                             headers=headers).status_code == 401
        one_token = {"text": "1", "sampling_params": {"max_new_tokens": 1}}
        assert http.post(f"{url}/generate", json=one_token).status_code == 401
        assert http.get(f"{url}/model_info").status_code == 401
        assert http.get(f"{url}/health").status_code == 200, "health stays open, as in SGLang"
        info = http.get(f"{url}/model_info", headers={"Authorization": f"Bearer {api_key}"}).json()
    assert info["weight_version"] != "evil"


def test_secrets_stay_out_of_parameters_logs_artifacts_and_sinks(
    prefect_server: str, auth_fleet, s3_server: S3Server, tmp_path: Path, tiny_model: Path  # type: ignore[no-untyped-def]
) -> None:
    """An end-to-end point on the auth-enabled fleet with S3 staging; every secret is planted in a
    block's secret field, then searched for in everything the point left on the Prefect server."""
    fleet, api_key, admin_key = auth_fleet
    s3_secret = f"s3-secret-{uuid.uuid4().hex}"  # moto accepts any secret; this one is planted
    bucket = s3_server.make_bucket("sec")
    block = FleetBlock(name=f"auth-{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(fleet.state_file),
                       api_key=SecretStr(api_key), admin_api_key=SecretStr(admin_key))
    env = save_point_blocks(tmp_path, block)
    StagingBlock(root=f"s3://{bucket}/stage", endpoint_url=s3_server.endpoint_url, aws_access_key_id=SecretStr(KEY),
                 aws_secret_access_key=SecretStr(s3_secret), cache_dir=str(tmp_path / "cache")
                 ).save(env.blocks["staging"], overwrite=True)
    opts = {"key": KEY, "secret": s3_secret, "endpoint_url": s3_server.endpoint_url}
    local = write_step_snapshot(tiny_model, str(tmp_path / "snap-71"))
    dest = Staging(f"s3://{bucket}/stage", storage_options=opts).put(local, env.run, 71)
    state = eval_point(**env.params(71, source={"kind": "staged", "path": dest}), return_state=True)
    assert state.name == "Completed", state.message
    [row, *_] = JsonlSink(env.jsonl).read(env.run)
    assert row.weight_version == "71"

    flow_run_id = str(state.state_details.flow_run_id)
    secrets = [api_key, admin_key, s3_secret]
    with prefect_rest_client(prefect_server) as api:
        fr = api.get(f"/flow_runs/{flow_run_id}").raise_for_status().json()
        logs = api.post("/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200}
                        ).raise_for_status().json()
        artifacts = api.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
                             ).raise_for_status().json()
        task_runs = api.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}}
                             ).raise_for_status().json()
        blocks = api.post("/block_documents/filter", json={"include_secrets": False}).raise_for_status().json()
    assert logs and artifacts and task_runs, "there is something to search"
    haystacks = {
        "flow-run parameters": json.dumps(fr["parameters"]),
        "flow run": json.dumps(fr),
        "run logs": json.dumps(logs),
        "artifacts": json.dumps(artifacts),
        "task runs": json.dumps(task_runs),
        "block documents (as the UI reads them)": json.dumps(blocks),
        "JSONL sink": env.jsonl.read_text(),
    }
    for where, text in haystacks.items():
        for secret in secrets:
            assert secret not in text, f"a planted secret leaked into {where}"
    assert api_key not in json.dumps({k: v for k, v in os.environ.items()}), "and the test env never held it"


# ---- Prefect API auth: trainer REST client, the flow, the CLI ----------------------------------


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    home = tmp_path_factory.mktemp("auth-prefect")
    server = start_server(home, free_port(), auth_string=AUTH)
    env = server_env(home, int(server.api_url.rsplit(":", 1)[1].split("/")[0]))
    for inherited in ("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING", "PINNED_EVAL_API_AUTH_FILE"):
        env.pop(inherited, None)  # the session server's credential, say: each test names its own
    env["PYTHONPATH"] = str(REPO)
    try:
        yield server.api_url, env
    finally:
        stop_server(server.pid)


def test_trainer_rest_client_sends_the_auth_string(auth_server) -> None:  # type: ignore[no-untyped-def]
    api, _ = auth_server
    with api_client(PrefectApiSettings(PREFECT_API_AUTH_STRING=AUTH)) as http:
        assert PrefectRest(api, http).point_runs("nobody") == []
    with api_client(PrefectApiSettings.model_construct()) as http, pytest.raises(httpx.HTTPStatusError) as info:
        PrefectRest(api, http).point_runs("nobody")
    assert info.value.response.status_code == 401
    with api_client(PrefectApiSettings(PREFECT_API_AUTH_STRING="pe-admin:wrong")) as http:
        assert http.post(f"{api}/flow_runs/filter", json={}).status_code == 401
    token = base64.b64encode(AUTH.encode()).decode()
    assert httpx.get(f"{api}/flows/", headers={"Authorization": f"Basic {token}"}, timeout=10).status_code in (200, 405)


_POINT = textwrap.dedent("""
    import sys, uuid
    from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
    from flows.eval_point import eval_point
    from tests.pointkit import SMALL_SUITE
    tmp, run = sys.argv[1], sys.argv[2]
    EvalSuiteBlock(suite=SMALL_SUITE).save("s", overwrite=True)
    FleetBlock(name="nowhere", mode="attach", engine_urls=["http://127.0.0.1:9"], router_url="http://127.0.0.1:9").save(
        "f", overwrite=True)
    StagingBlock(root=tmp + "/stage", source_roots=[tmp]).save("st", overwrite=True)
    SinksBlock(jsonl_path=tmp + "/m.jsonl").save("si", overwrite=True)
    state = eval_point(run=run, step=3, source={"kind": "hf", "path": tmp + "/no-such-ckpt"}, suite="s", fleet="f",
                       staging="st", sinks="si", return_state=True)
    print("STATE", state.name, state.message)
""")


def test_flow_and_cli_work_with_the_auth_string_and_fail_clearly_without(auth_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _api, env = auth_server
    run = f"a{uuid.uuid4().hex[:8]}"
    ok = subprocess.run([sys.executable, "-c", _POINT, str(tmp_path), run], cwd=REPO, capture_output=True, text=True,
                        timeout=240, env=dict(env, PREFECT_API_AUTH_STRING=AUTH))
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-3000:]
    assert "STATE Skipped ckpt_missing" in ok.stdout, ok.stdout[-2000:]

    cli = [sys.executable, "-m", "app.cli", "status", "--run", run, "--json"]
    status = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=dict(env, PREFECT_API_AUTH_STRING=AUTH))
    assert status.returncode == 0, status.stdout + status.stderr
    [point] = json.loads(status.stdout)["points"]
    assert (point["step"], point["reason"]) == (3, "ckpt_missing")

    denied = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert denied.returncode != 0
    assert "401" in denied.stdout + denied.stderr or "Unauthorized" in denied.stdout + denied.stderr, (
        denied.stdout[-1500:] + denied.stderr[-1500:])
    flow = subprocess.run([sys.executable, "-c", _POINT, str(tmp_path), run + "x"], cwd=REPO, capture_output=True,
                          text=True, timeout=240, env=env)
    assert flow.returncode != 0 and "401" in flow.stdout + flow.stderr, flow.stdout[-1500:] + flow.stderr[-1500:]


# ---- loopback by default ------------------------------------------------------------------------


def _listening(pid: int) -> list[str]:
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    return [c.laddr.ip for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def test_engines_router_and_server_listen_on_loopback_only(prefect_server: str, cpu_fleet: CpuFleet) -> None:
    launched = LaunchedFleet.load(cpu_fleet.state_file)
    pids = {f"engine {u}": launched.pid_of(u) for u in launched.engine_urls}
    assert launched.state.router is not None
    pids["router"] = launched.state.router.pid
    port = int(prefect_server.rsplit(":", 1)[1].split("/")[0])
    [server_pid] = {c.pid for c in psutil.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid}
    pids["prefect server"] = server_pid
    for what, pid in pids.items():
        ips = _listening(pid)
        assert ips, f"{what} listens somewhere"
        assert set(ips) <= {"127.0.0.1"}, f"{what} listens on {ips}"
