"""Launch a fleet: N engines (CPU engines or real SGLang) + sglang-router, all on 127.0.0.1.

Contract:
- `launch_fleet` starts every engine in its own process group (logs under `log_dir`), waits until
  each answers `/health` and `/model_info`, then starts the router with exactly those engines and
  waits until it lists all of them healthy. Anything failing stops what was started and raises
  `LaunchError`. The returned `LaunchedFleet` writes a JSON state file (PIDs, start times,
  commands, ports, keys) so another process (`pinned-eval fleet down`, a flow run) can revive,
  stop or talk to it (`LaunchedFleet.client`).
- Keys: every launched engine has an API key and an admin key, the router the API key
  (`FleetKeys.resolve`: configured ones, else generated). They reach the processes by environment
  (CPU engine, router wrapper) or a 0600 `--config` file (real SGLang), never argv. The state file
  is 0600 in a 0700 directory; logs are 0600 in a 0700 `log_dir`; every `LaunchError` leaving
  this module is scrubbed of the keys (`fleet.keys.scrub`).
- `LaunchedFleet.revive(url)` kills that engine's process group and relaunches the same command
  on the same port, returning when it is healthy. Its weights are then the boot checkpoint: the
  fleet client must pin it again before it serves.
- `stop()` kills router and engines by recorded PID/process group only, then removes the SGLang
  key file and the state file.
- Ports are free ports picked at launch; the router's Prometheus port too (its default clashes).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field

from pinned_eval.fleet.client import FleetClient, FleetConfig
from pinned_eval.fleet.cpu_engine import CpuEngineArgs, engine_spec
from pinned_eval.fleet.keys import (
    ROUTER_API_KEY_ENV,
    FleetKeys,
    private_dir,
    private_file,
    scrubbed_launch_errors,
    write_private,
    write_sglang_key_config,
)
from pinned_eval.fleet.models import normalize_url
from pinned_eval.fleet.sglang_args import SGLangFleetSpec, sglang_engine_specs
from pinned_eval.processes import (
    LaunchError,
    ProcessRecord,
    ProcessSpec,
    free_port,
    is_running,
    start_process,
    stop_process,
    stop_processes,
    wait_healthy,
    wait_http_ok,
)
from pinned_eval.settings import Settings

STATE_FORMAT = 1
SGLANG_KEY_CONFIG = "sglang-keys.yaml"  # in the fleet's log dir; removed by stop()


def default_state_file() -> Path:
    return Settings().home / "fleet" / "fleet.json"


class FleetState(BaseModel):
    """What a state file holds: enough to revive and stop the fleet from any process."""

    format: int = STATE_FORMAT
    engines: list[ProcessRecord]
    router: ProcessRecord | None = None
    log_dir: str
    created_at: float = Field(default_factory=time.time)
    keys: FleetKeys | None = Field(default=None, description="None: a state file from before fleet keys.")


def cpu_engine_specs(
    model_path: str | Path,
    n_engines: int,
    *,
    weight_version: str | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    threads_per_engine: int | None = None,
    python: str = sys.executable,
    tool_call_parser: Literal["qwen25", "hermes"] | None = None,
) -> list[ProcessSpec]:
    """`python -m engine` (the bundled CPU engine) commands, one free port each; the keys go in
    each engine's environment (never its argv); `tool_call_parser` is SGLang's
    `--tool-call-parser` (tool calls parsed in /v1/chat/completions replies)."""
    threads = threads_per_engine or max(1, (os.cpu_count() or 1) // n_engines)
    specs = []
    for _ in range(n_engines):
        args = CpuEngineArgs(
            model_path=str(model_path),
            port=free_port(),
            weight_version=weight_version or "default",
            api_key=api_key,
            admin_api_key=admin_api_key,
            threads=threads,
            tool_call_parser=tool_call_parser,
        )
        env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        specs.append(engine_spec(args, python=python, env=env).model_copy(update={"health_path": "/health"}))
    return specs


def router_spec(
    worker_urls: list[str],
    *,
    port: int | None = None,
    policy: str = "round_robin",
    api_key: str | None = None,
    health_check_interval_s: int = 2,
    python: str = sys.executable,
) -> ProcessSpec:
    """sglang-router on 127.0.0.1 fronting `worker_urls`, through `fleet.router_main` so that its API
    key (also the workers' key it forwards) travels in the environment, not in argv."""
    port = port or free_port()
    cmd = [python, "-m", "pinned_eval.fleet.router_main", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    cmd += ["--health-check-interval-secs", str(health_check_interval_s), "--worker-startup-check-interval", "1"]
    cmd += ["--health-check-timeout-secs", "30"]  # SGLang's /health generates a token: slow under load
    # The router's circuit breaker counts every non-2xx reply as the worker's failure: ten 400s for
    # over-long prompts (the request's fault) opened it and the next point's pin waited out its 60 s
    # with 503s. Liveness is the health checker's (and the fleet client's revive), not the breaker's.
    cmd += ["--disable-circuit-breaker"]
    cmd += ["--log-level", "warn"]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    return ProcessSpec(role="router", command=cmd, port=port, env={ROUTER_API_KEY_ENV: api_key} if api_key else {})


class LaunchedFleet:
    """Handle on launched processes: URLs, revive, stop; persisted to `state_file` when given."""

    def __init__(
        self,
        state: FleetState,
        state_file: Path | None = None,
        *,
        ready_timeout_s: float = 300.0,
        api_key: str | None = None,
    ) -> None:
        self.state = state
        self.state_file = state_file
        self.ready_timeout_s = ready_timeout_s
        self._api_key = api_key or (state.keys.api if state.keys else None)
        self._headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    @property
    def keys(self) -> FleetKeys | None:
        """The keys the fleet was launched with (None for a state file from before fleet keys)."""
        return self.state.keys

    def client_config(self, config: FleetConfig | None = None) -> FleetConfig:
        """`config` (default: `FleetConfig()`) with this fleet's keys where it sets none."""
        config = config or FleetConfig()
        keys = self.state.keys
        if keys is None:
            return config
        return config.model_copy(
            update={"api_key": config.api_key or keys.api, "admin_api_key": config.admin_api_key or keys.admin}
        )

    def client(self, config: FleetConfig | None = None, **kwargs: Any) -> FleetClient:
        """A fleet client over these engines and router, with this fleet's keys, reviving through it."""
        return FleetClient(self.engine_urls, self.router_url, config=self.client_config(config), reviver=self,
                           **kwargs)

    @classmethod
    def load(cls, state_file: Path, *, ready_timeout_s: float = 300.0, api_key: str | None = None) -> LaunchedFleet:
        """Re-open a fleet launched by another process from its state file (which holds its keys)."""
        state = FleetState.model_validate_json(state_file.read_text())
        if state.format != STATE_FORMAT:
            raise LaunchError(f"{state_file}: state format {state.format}, this pinned-eval reads {STATE_FORMAT}")
        return cls(state, state_file, ready_timeout_s=ready_timeout_s, api_key=api_key)

    @property
    def engine_urls(self) -> list[str]:
        return [r.url for r in self.state.engines]

    @property
    def router_url(self) -> str | None:
        return self.state.router.url if self.state.router else None

    def manages(self, url: str) -> bool:
        return normalize_url(url) in self.engine_urls

    def running(self) -> dict[str, bool]:
        """Liveness of every recorded process by PID (not by HTTP)."""
        records = [*self.state.engines, *([self.state.router] if self.state.router else [])]
        return {f"{r.spec.role} {r.url}": is_running(r) for r in records}

    def pid_of(self, url: str) -> int:
        return self._index(url)[1].pid

    def _index(self, url: str) -> tuple[int, ProcessRecord]:
        url = normalize_url(url)
        for i, rec in enumerate(self.state.engines):
            if rec.url == url:
                return i, rec
        raise KeyError(f"{url} is not an engine of this fleet ({self.engine_urls})")

    def revive(self, url: str) -> None:
        """Kill the engine's process group, relaunch the same command on the same port, wait healthy."""
        i, old = self._index(url)
        stop_process(old)
        with scrubbed_launch_errors(self._secrets()):
            new, popen = start_process(old.spec, private_file(Path(old.log_path)))
            self.state.engines[i] = new
            self.save()
            wait_http_ok(new, timeout_s=self.ready_timeout_s, headers=self._headers, popen=popen)

    def _secrets(self) -> list[str | None]:
        return [self._api_key, *(self.state.keys.values() if self.state.keys else [])]

    def stop(self) -> None:
        """Stop the router and every engine (by recorded PID/process group); remove the state file."""
        stop_processes([*([self.state.router] if self.state.router else []), *self.state.engines])
        (Path(self.state.log_dir) / SGLANG_KEY_CONFIG).unlink(missing_ok=True)
        if self.state_file is not None:
            self.state_file.unlink(missing_ok=True)

    def save(self) -> None:
        """Write the state file: mode 0600 in a 0700 directory (it holds the keys)."""
        if self.state_file is not None:
            write_private(self.state_file, self.state.model_dump_json(indent=2))

    def __enter__(self) -> LaunchedFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_router_members(router: ProcessRecord, urls: list[str], timeout_s: float, headers: dict[str, str]) -> None:
    wanted = {normalize_url(u) for u in urls}
    last = "no answer"
    with httpx.Client(timeout=10.0) as http:

        def all_listed() -> bool:
            nonlocal last
            try:
                resp = http.get(f"{router.url}/workers", headers=headers)
            except httpx.TransportError as exc:
                last = repr(exc)
                return False
            if resp.status_code != 200:
                last = f"HTTP {resp.status_code}"
                return False
            healthy = {normalize_url(w["url"]) for w in resp.json()["workers"] if w.get("is_healthy")}
            last = f"healthy {sorted(healthy)}"
            return wanted <= healthy

        what = lambda: f"router {router.url} listing {sorted(wanted)} ({last})"  # noqa: E731
        wait_healthy(router, all_listed, timeout_s=timeout_s, what=what)


def launch_fleet(
    engine_specs: list[ProcessSpec],
    *,
    log_dir: Path,
    state_file: Path | None = None,
    router_port: int | None = None,
    policy: str = "round_robin",
    keys: FleetKeys | None = None,
    with_router: bool = True,
    ready_timeout_s: float = 300.0,
) -> LaunchedFleet:
    """Start the engines, wait healthy, start the router over them, wait until it lists them all.

    `engine_specs` already carry the engines' keys (`keys`, generated when None, is what the
    state file records, the health probes send and the router gets)."""
    if not engine_specs:
        raise ValueError("engine_specs: a fleet needs at least one engine")
    keys = keys or FleetKeys.resolve()
    headers = {"Authorization": f"Bearer {keys.api}"}
    private_dir(log_dir)
    with scrubbed_launch_errors(keys.values()):
        started = [start_process(s, private_file(log_dir / f"engine-{s.port}.log")) for s in engine_specs]
        fleet = LaunchedFleet(
            FleetState(engines=[rec for rec, _ in started], log_dir=str(log_dir), keys=keys),
            state_file,
            ready_timeout_s=ready_timeout_s,
        )
        try:
            fleet.save()
            for rec, popen in started:
                wait_http_ok(rec, timeout_s=ready_timeout_s, headers=headers, popen=popen)
                wait_http_ok(rec, timeout_s=ready_timeout_s, path="/model_info", headers=headers, popen=popen)
            if with_router:
                spec = router_spec(fleet.engine_urls, port=router_port, policy=policy, api_key=keys.api)
                router, popen = start_process(spec, private_file(log_dir / f"router-{spec.port}.log"))
                fleet.state.router = router
                fleet.save()
                wait_http_ok(router, timeout_s=ready_timeout_s, popen=popen)
                _wait_router_members(router, fleet.engine_urls, ready_timeout_s, headers)
        except BaseException:
            fleet.stop()
            raise
    return fleet


def launch_cpu_fleet(
    model_path: str | Path,
    n_engines: int,
    *,
    log_dir: Path | None = None,
    state_file: Path | None = None,
    weight_version: str | None = None,
    router_port: int | None = None,
    policy: str = "round_robin",
    api_key: str | None = None,
    admin_api_key: str | None = None,
    ready_timeout_s: float = 300.0,
    tool_call_parser: Literal["qwen25", "hermes"] | None = None,
) -> LaunchedFleet:
    """N bundled CPU engines serving `model_path` behind sglang-router; keys not given are generated."""
    keys = FleetKeys.resolve(api_key, admin_api_key)
    specs = cpu_engine_specs(
        model_path, n_engines, weight_version=weight_version, api_key=keys.api, admin_api_key=keys.admin,
        tool_call_parser=tool_call_parser,
    )
    log_dir = log_dir or (state_file.parent if state_file else Settings().home / "fleet") / "logs"
    return launch_fleet(
        specs, log_dir=log_dir, state_file=state_file, router_port=router_port, policy=policy,
        keys=keys, ready_timeout_s=ready_timeout_s,
    )


def launch_sglang_fleet(
    spec: SGLangFleetSpec,
    *,
    log_dir: Path,
    state_file: Path | None = None,
    router_port: int | None = None,
    policy: str = "round_robin",
    api_key: str | None = None,
    admin_api_key: str | None = None,
    ready_timeout_s: float = 1800.0,
) -> LaunchedFleet:
    """Real SGLang engines on this host's GPUs (see `sglang_args`) behind sglang-router; keys not
    given are generated and reach SGLang in a 0600 `--config` file under the 0700 `log_dir`."""
    keys = FleetKeys.resolve(api_key, admin_api_key)
    key_config = write_sglang_key_config(private_dir(log_dir) / SGLANG_KEY_CONFIG, keys)
    specs = sglang_engine_specs(spec, [free_port() for _ in range(spec.num_engines)], key_config=key_config)
    return launch_fleet(
        specs, log_dir=log_dir, state_file=state_file, router_port=router_port, policy=policy,
        keys=keys, ready_timeout_s=ready_timeout_s,
    )
