"""Engine keys, unit level: no key in any command pinned-eval builds (real SGLang, CPU engine,
router, reference backend); real SGLang gets its keys from a 0600 `--config` YAML; text that
leaves a launcher is scrubbed."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pinned_eval.fleet.cpu_engine import CpuEngineArgs, engine_command, engine_spec
from pinned_eval.fleet.keys import (
    ENGINE_ADMIN_API_KEY_ENV,
    ENGINE_API_KEY_ENV,
    ROUTER_API_KEY_ENV,
    FleetKeys,
    scrub,
    write_sglang_key_config,
)
from pinned_eval.fleet.launcher import FleetState, launch_fleet, router_spec
from pinned_eval.fleet.sglang_args import SGLangFleetSpec, resolve_server_args, sglang_engine_specs
from pinned_eval.processes import LaunchError, ProcessSpec, free_port

API, ADMIN = "sk-data-0123456789abcdef", "sk-admin-fedcba9876543210"
KEYS = FleetKeys.resolve(API, ADMIN)


def _no_key(argv: list[str]) -> None:
    joined = " ".join(argv)
    assert API not in joined and ADMIN not in joined, joined
    assert "--api-key" not in argv and "--admin-api-key" not in argv, joined


def test_real_sglang_command_carries_only_the_key_config_path(tmp_path: Path) -> None:
    config = write_sglang_key_config(tmp_path / "fleet" / "sglang-keys.yaml", KEYS)
    spec = SGLangFleetSpec(model_path="/m", num_gpus=2, python="/py", base_args={"api_key": "base-key"})
    engines = sglang_engine_specs(spec, [31001, 31002], key_config=config)
    for engine in engines:
        _no_key(engine.command)
        assert "base-key" not in " ".join(engine.command)  # a key in the base args is launcher-owned: dropped
        assert engine.command.count("--config") == 1  # SGLang accepts one --config only
        assert engine.command[engine.command.index("--config") + 1] == str(config)
        assert not any(k for k in engine.env if "KEY" in k)
    # what SGLang's ConfigArgumentMerger reads: flag names as YAML keys, values the keys
    assert yaml.safe_load(config.read_text()) == {"api-key": API, "admin-api-key": ADMIN}
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE(config.parent.stat().st_mode) == 0o700
    with pytest.raises(ValueError, match="yaml"):
        write_sglang_key_config(tmp_path / "keys.json", KEYS)


def test_keys_in_sglang_overrides_are_refused_naming_the_field() -> None:
    for field in ("api_key", "admin_api_key", "config"):
        with pytest.raises(ValidationError, match=rf"overrides\.{field}"):
            SGLangFleetSpec(model_path="/m", num_gpus=1, overrides={field: "x"})
    resolved = resolve_server_args(SGLangFleetSpec(model_path="/m", num_gpus=1, base_args={"admin_api_key": "x"}))
    assert "admin_api_key" not in resolved and "api_key" not in resolved


def test_cpu_engine_and_router_get_their_keys_by_environment() -> None:
    args = CpuEngineArgs(model_path="/m", port=4321, api_key=API, admin_api_key=ADMIN)
    spec = engine_spec(args, python="/py", env={"OMP_NUM_THREADS": "1"})
    _no_key(spec.command)
    assert spec.env == {"OMP_NUM_THREADS": "1", ENGINE_API_KEY_ENV: API, ENGINE_ADMIN_API_KEY_ENV: ADMIN}
    assert API not in repr(args) and ADMIN not in repr(args)
    with pytest.raises(ValueError, match="extra_args: --api-key"):
        engine_command(args, extra_args=["--api-key", API])
    router = router_spec(["http://127.0.0.1:1"], port=4322, api_key=API)
    _no_key(router.command)
    assert router.command[1:3] == ["-m", "pinned_eval.fleet.router_main"] and router.env == {ROUTER_API_KEY_ENV: API}


def test_engine_reads_the_same_variables_the_launcher_sets() -> None:
    from engine.launch import ADMIN_API_KEY_ENV, API_KEY_ENV  # engine is a leaf: it keeps its own copy

    assert (API_KEY_ENV, ADMIN_API_KEY_ENV) == (ENGINE_API_KEY_ENV, ENGINE_ADMIN_API_KEY_ENV)


def test_reference_backend_sglang_launch_has_no_key_in_argv(tmp_path: Path) -> None:
    from trainer_integration.sglang_backend import SGLangBackendConfig, launch_spec, sglang_launch_spec

    cfg = SGLangBackendConfig(launch="sglang", model_path="/base", gpus=[6, 7], api_key=API, admin_api_key=ADMIN)
    config = write_sglang_key_config(tmp_path / "keys.yaml", KEYS)
    spec = sglang_launch_spec(cfg, 31000, config)
    _no_key(spec.command)
    assert spec.command[spec.command.index("--config") + 1] == str(config)
    cpu = launch_spec(SGLangBackendConfig(launch="cpu", model_path="/base", port=4321), KEYS)
    _no_key(cpu.command)
    assert cpu.env[ENGINE_ADMIN_API_KEY_ENV] == ADMIN
    with pytest.raises(ValidationError, match="extra_args: --admin-api-key"):
        SGLangBackendConfig(launch="cpu", model_path="/base", extra_args=[f"--admin-api-key={ADMIN}"])


def test_scrub_removes_known_keys_and_key_shapes() -> None:
    sglang_log = f"server_args=ServerArgs(model_path='/m', api_key='{API}', admin_api_key='{ADMIN}', port=1)"
    assert scrub(sglang_log, KEYS.values()) == (
        "server_args=ServerArgs(model_path='/m', api_key='<redacted>', admin_api_key='<redacted>', port=1)"
    )
    unknown = "argv: --api-key other-secret --admin-api-key=x2 | Authorization: Bearer tok.en"
    assert scrub(unknown) == "argv: --api-key <redacted> --admin-api-key=<redacted> | Authorization: Bearer <redacted>"
    assert scrub(f"plain {API} in a traceback", KEYS.values()) == "plain <redacted> in a traceback"


def test_a_launch_error_log_tail_is_scrubbed(tmp_path: Path) -> None:
    """An engine that prints its keys (as SGLang prints its server args) and exits: the
    LaunchError's log tail shows neither key; the log itself is 0600 in a 0700 directory."""
    printer = "import os; print('api_key=' + os.environ['K1'], os.environ['K2']); raise SystemExit(3)"
    spec = ProcessSpec(role="engine", command=[sys.executable, "-c", printer], env={"K1": API, "K2": ADMIN},
                       port=free_port())
    log_dir = tmp_path / "logs"
    with pytest.raises(LaunchError) as err:
        launch_fleet([spec], log_dir=log_dir, keys=KEYS, with_router=False, ready_timeout_s=30)
    text = str(err.value)
    assert "exited before it was healthy" in text and "<redacted>" in text, text
    assert API not in text and ADMIN not in text
    [log] = log_dir.glob("engine-*.log")
    assert API in log.read_text()  # the log keeps what the process wrote; its mode protects it
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and stat.S_IMODE(log_dir.stat().st_mode) == 0o700


def test_state_file_keeps_the_keys_for_clients_at_0600(tmp_path: Path) -> None:
    from pinned_eval.fleet.launcher import LaunchedFleet

    state_file = tmp_path / "fleet" / "fleet.json"
    LaunchedFleet(FleetState(engines=[], log_dir=str(tmp_path), keys=KEYS), state_file).save()
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(state_file.parent.stat().st_mode) == 0o700
    again = LaunchedFleet.load(state_file)
    assert again.keys == KEYS
    config = again.client_config()
    assert (config.api_key, config.admin_api_key) == (API, ADMIN)
    assert API not in repr(again.state) and ADMIN not in repr(config)


def test_generated_keys_never_start_with_a_dash() -> None:
    """SGLang merges its `--config` YAML into argv: a key `-x...` would read as a missing value
    (about 1 key in 64 with URL-safe base64; 2000 draws make that certain)."""
    from pinned_eval.fleet.keys import new_key

    keys = [new_key() for _ in range(2000)]
    assert [k for k in keys if k.startswith("-")] == []
    assert {len(k) for k in keys} == {64} and len(set(keys)) == 2000
