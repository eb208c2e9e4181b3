"""Reference external backend: one SGLang-protocol server, attached by URL or launched by us.

`SGLangCheckpointEval(**options)` (options = `SGLangBackendConfig` fields; with no options they
come from `PINNED_EVAL_EXTERNAL_*` variables, like miles' `MILES_EXTERNAL_EVAL_*`):
- `url=...` attaches to a running server; `launch="sglang"` starts
  `python -m sglang.launch_server` on `gpus` (CUDA_VISIBLE_DEVICES = those ids, TP = their count,
  command built by the fleet's `sglang_args`, raw `extra_args` appended last); `launch="cpu"`
  starts the bundled CPU engine. Launch happens in the constructor; the health wait is deferred to
  the first eval (miles: server load never blocks the caller).
- `evaluate_checkpoint`: wait `GET /health_generate` (an attached server that never answers →
  `EvalSkip("unhealthy")`; a launched one that exits → `LaunchError`, a crash), then pin with the
  fleet client's one pin-and-read-back (`FleetClient.pin`): load `update_weights_from_disk` with
  `weight_version`, read back `/model_info`; accept only `weight_version == str(step)` and
  `model_path == checkpoint_dir`; 2 attempts, then `EvalSkip("pin_violation")`. Then generate
  every dataset through the same rollout path as the flow's generate task
  (`pinned_eval.rollout.run_rollouts` on a `PointSession` over this server: every prompt rendered
  first, chat template from the checkpoint's tokenizer; n samples per prompt, deterministic
  `sampling_seed`, abort finishes retried, rids `<run>-<step>-ext-<dataset>-<prompt>-<j>`) and
  score with the suite's rewards as the flow's score task does (a miles `async (args, sample)`
  reward gets `EvalSuite.miles_args(ds)`). Errors map to skips as `pinned_eval.skip_mapping` says: a response
  from other weights → `pin_violation`; a server that stops serving → `unhealthy`; a remote
  reward service that gives no reward → `reward_unavailable`.
- Keys: a launched server always has an API key and an admin key (the configured ones, else
  generated); the CPU engine gets them in its environment, SGLang in a 0600 `--config` YAML under
  the 0700 log dir, never on the command line (`extra_args` with a key flag are refused). Its log
  is 0600, and a launch error's log tail is scrubbed of the keys before it is raised.
- `dispose()` stops the process group it launched (by recorded PID and start time), never an
  attached server. Idempotent.
`history` records every pin attempt and generate count, for logs and tests.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pinned_eval.datasets.loader import load_dataset
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.external import (
    CheckpointEvalFn,
    DatasetResult,
    EvalInput,
    EvalResults,
    EvalSkip,
)
from pinned_eval.fleet.client import FleetClient, FleetConfig
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.fleet.keys import (
    FleetKeys,
    private_dir,
    private_file,
    refuse_key_flags,
    scrub,
    write_sglang_key_config,
)
from pinned_eval.fleet.launcher import cpu_engine_specs
from pinned_eval.fleet.models import EngineCheck, EngineInfo, normalize_path, normalize_url
from pinned_eval.fleet.sglang_args import SGLangFleetSpec, sglang_engine_specs
from pinned_eval.polling import PollTimeout, apoll_until
from pinned_eval.processes import (
    LaunchError,
    ProcessRecord,
    ProcessSpec,
    free_port,
    is_running,
    log_tail,
    start_process,
    stop_process,
)
from pinned_eval.rollout import PointSession, Sample, run_rollouts
from pinned_eval.scoring.metrics import LENGTH_FINISH_REASON, ScoredSample
from pinned_eval.scoring.remote import RewardItem, score_responses
from pinned_eval.settings import Settings
from pinned_eval.skip_mapping import fleet_skips
from pinned_eval.skips import SkipReason

ENV_PREFIX = "PINNED_EVAL_EXTERNAL_"


class SGLangBackendConfig(BaseModel):
    """Options of the reference backend: attach (`url`) or launch (`launch` + `model_path`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str | None = Field(default=None, description="Attach to this server (SGLang native API).")
    launch: Literal["sglang", "cpu"] | None = Field(default=None, description="Launch our own server.")
    model_path: str | None = Field(default=None, description="Checkpoint a launched server boots from.")
    gpus: list[int] | None = Field(default=None, description="GPU ids of a launched SGLang server; TP = count.")
    port: int | None = Field(default=None, gt=0, lt=65536, description="Launch port; default a free one.")
    server_args: dict[str, Any] = Field(default_factory=dict, description="SGLang ServerArgs fields.")
    extra_args: list[str] = Field(default_factory=list, description="Raw server flags, appended last.")
    api_key: str | None = Field(default=None, repr=False)
    admin_api_key: str | None = Field(default=None, repr=False)
    python: str = Field(default=sys.executable, description="Interpreter of a launched server.")
    log_dir: str | None = Field(default=None, description="Launched server logs; default <home>/external.")
    ready_timeout_s: float = Field(default=1800.0, gt=0, description="Wait for /health_generate.")
    load_timeout_s: float = Field(default=600.0, gt=0, description="One weight load.")
    pin_attempts: int = Field(default=2, ge=1)
    max_concurrency: int = Field(default=32, ge=1, description="Most /generate requests in flight.")
    request_timeout_s: float = Field(default=600.0, gt=0)
    abort_retries: int = Field(default=3, ge=0)

    @field_validator("gpus", mode="before")
    @classmethod
    def _parse_gpus(cls, v: Any) -> Any:
        return [int(g) for g in v.split(",") if g.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _one_mode(self) -> SGLangBackendConfig:
        if (self.url is None) == (self.launch is None):
            raise ValueError("url / launch: give exactly one (attach to a server, or launch one)")
        if self.launch is not None and not self.model_path:
            raise ValueError("model_path: a launched server needs a checkpoint to boot from")
        if self.launch == "sglang" and not self.gpus:
            raise ValueError("gpus: launch='sglang' needs GPU ids, e.g. [6, 7]")
        if self.launch != "sglang" and self.gpus:
            raise ValueError("gpus: only used with launch='sglang'")
        refuse_key_flags(self.extra_args, "extra_args")
        return self

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> SGLangBackendConfig:
        """`PINNED_EVAL_EXTERNAL_{URL,GPUS,PORT,MODEL_PATH,SERVER_ARGS}`; GPUS alone means launch sglang."""
        env = os.environ if environ is None else environ
        get = lambda name: env.get(ENV_PREFIX + name) or None  # noqa: E731
        url, gpus = get("URL"), get("GPUS")
        values: dict[str, Any] = {"url": url}
        if url is None:
            values.update(launch=get("LAUNCH") or ("sglang" if gpus else None), gpus=gpus)
            values.update(model_path=get("MODEL_PATH"), port=get("PORT"))
        values["extra_args"] = shlex.split(get("SERVER_ARGS") or "")
        return cls.model_validate({k: v for k, v in values.items() if v is not None})


def sglang_launch_spec(config: SGLangBackendConfig, port: int, key_config: Path | None = None) -> ProcessSpec:
    """The real SGLang server command + env of a `launch="sglang"` config (fleet code, one engine);
    `key_config` is the 0600 YAML with its keys (`--config`)."""
    if config.launch != "sglang" or not config.gpus or not config.model_path:
        raise ValueError("launch: sglang_launch_spec needs launch='sglang' with gpus and model_path")
    spec = SGLangFleetSpec(
        model_path=normalize_path(config.model_path),
        num_gpus=len(config.gpus),
        gpus_per_engine=len(config.gpus),
        gpu_ids=config.gpus,
        base_args=config.server_args,
        python=config.python,
    )
    [engine] = sglang_engine_specs(spec, [port], key_config=key_config)
    return engine.model_copy(update={"command": [*engine.command, *config.extra_args]})


def launch_spec(
    config: SGLangBackendConfig, keys: FleetKeys | None = None, key_config: Path | None = None
) -> ProcessSpec:
    """What a launching config starts: real SGLang on GPUs (keys in `key_config`), or the bundled
    CPU engine (`keys`, default the configured ones, in its environment)."""
    if config.launch == "sglang":
        return sglang_launch_spec(config, config.port or free_port(), key_config)
    assert config.model_path is not None  # validated
    api_key, admin = (keys.api, keys.admin) if keys else (config.api_key, config.admin_api_key)
    [spec] = cpu_engine_specs(
        normalize_path(config.model_path), 1, api_key=api_key, admin_api_key=admin, python=config.python
    )
    if config.port is not None:
        command = list(spec.command)
        command[command.index("--port") + 1] = str(config.port)
        spec = spec.model_copy(update={"command": command, "port": config.port})
    return spec.model_copy(update={"command": [*spec.command, *config.extra_args]})


@dataclass
class PinAttempt:
    attempt: int
    load_ok: bool
    weight_version: str | None
    model_path: str | None
    problem: str


@dataclass
class BackendHistory:
    """What this backend did: pin attempts (in order) and /generate results per point."""

    pins: list[PinAttempt] = field(default_factory=list)
    generated: int = 0


class SGLangCheckpointEval(CheckpointEvalFn):
    """The reference `CheckpointEvalFn` (see the module docstring)."""

    def __init__(self, **options: Any) -> None:
        self.config = SGLangBackendConfig(**options) if options else SGLangBackendConfig.from_env()
        self.history = BackendHistory()
        self._process: ProcessRecord | None = None
        self._key_config: Path | None = None
        self._healthy = False
        self._api_key, self._admin_api_key = self.config.api_key, self.config.admin_api_key
        if self.config.url is not None:
            self.url = normalize_url(self.config.url)
            return
        keys = FleetKeys.resolve(self.config.api_key, self.config.admin_api_key)
        self._api_key, self._admin_api_key = keys.api, keys.admin
        log_dir = private_dir(Path(self.config.log_dir) if self.config.log_dir else Settings().home / "external")
        key_config = None
        if self.config.launch == "sglang":
            key_config = write_sglang_key_config(log_dir / f"keys-{os.getpid()}-{id(self):x}.yaml", keys)
            self._key_config = key_config
        spec = launch_spec(self.config, keys, key_config)
        self._process, _ = start_process(spec, private_file(log_dir / f"external-{spec.port}.log"))
        self.url = spec.url

    @property
    def launched(self) -> ProcessRecord | None:
        """The process this backend started (None when attached)."""
        return self._process

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=30.0)
        async with httpx.AsyncClient(timeout=timeout) as http:
            await self._wait_healthy(http)
            await self._pin(checkpoint_dir, input.weight_version)
            data = await self._generate_all(http, checkpoint_dir, input)
        return EvalResults(data=data)

    def dispose(self) -> None:
        if self._process is not None:
            stop_process(self._process)
            self._process = None
        if self._key_config is not None:
            self._key_config.unlink(missing_ok=True)
            self._key_config = None

    # ---- health and pin ----------------------------------------------------------------

    async def _wait_healthy(self, http: httpx.AsyncClient) -> None:
        if self._healthy:
            return
        last = "no answer yet"

        async def healthy() -> bool:
            nonlocal last
            if self._process is not None and not is_running(self._process):
                tail = scrub(log_tail(self._process.log_path), [self._api_key, self._admin_api_key])
                raise LaunchError(f"launched server {self.url} exited; log {self._process.log_path}:\n{tail}")
            try:
                resp = await http.get(f"{self.url}/health_generate", timeout=30.0)
            except httpx.TransportError as exc:
                last = repr(exc)
                return False
            last = f"HTTP {resp.status_code}"
            return resp.status_code == 200

        try:
            await apoll_until(healthy, timeout_s=self.config.ready_timeout_s, interval_s=0.5, what=lambda: last)
        except PollTimeout as exc:
            raise EvalSkip(SkipReason.UNHEALTHY, f"{self.url} not healthy: {exc}") from None
        self._healthy = True

    async def _pin(self, checkpoint_dir: str, version: str) -> EngineInfo:
        """The fleet client's pin-and-read-back on this one server (`pin_attempts` attempts)."""
        config = FleetConfig(
            api_key=self._api_key,
            admin_api_key=self._admin_api_key,
            load_timeout_s=self.config.load_timeout_s,
            pin_attempts=self.config.pin_attempts,
        )

        def record(attempt: int, checks: list[EngineCheck]) -> None:
            for c in checks:
                self.history.pins.append(PinAttempt(attempt, c.load.ok, c.weight_version, c.model_path, c.problem))

        async with FleetClient([self.url], config=config) as fleet:
            with fleet_skips(self.url, as_type=EvalSkip):
                result = await fleet.pin(checkpoint_dir, version, on_attempt=record)
        return result.engines[0]

    # ---- generate and score ------------------------------------------------------------

    async def _generate_all(
        self, http: httpx.AsyncClient, checkpoint_dir: str, input: EvalInput
    ) -> dict[str, DatasetResult]:
        gen = RouterGenerator(
            http,
            self.url,
            api_key=self._api_key,
            max_concurrency=self.config.max_concurrency,
            abort_retries=self.config.abort_retries,
        )
        version = input.weight_version
        session = PointSession(
            gen, expected_version=version, rid_prefix=f"{input.run}-{input.step}-ext", tokenizer_dir=checkpoint_dir
        )
        rows = {ds.name: load_dataset(ds) for ds in input.datasets}
        try:
            with fleet_skips(f"{self.url} pinned to {version}", as_type=EvalSkip):
                samples = await run_rollouts(session, input.datasets, rows)
                results = await asyncio.gather(*(self._score(ds, samples, input) for ds in input.datasets))
        finally:
            self.history.generated += session.counters.completed
        return {ds.name: res for ds, res in zip(input.datasets, results, strict=True)}

    @staticmethod
    async def _score(ds: ResolvedDataset, samples: list[Sample], input: EvalInput) -> DatasetResult:
        """`ds`'s samples scored with the suite's reward, its `args` namespace as the flow's score
        task gives it (`EvalSuite.miles_args`); no reward from the service → reward_unavailable."""
        mine = [s for s in samples if s.dataset == ds.name]
        items = [RewardItem(s.prompt, s.response, s.label, s.metadata) for s in mine]
        rewards = await score_responses(ds.reward, items, input.suite.remote_reward, input.suite.miles_args(ds))
        scored = [
            ScoredSample(
                prompt_index=s.prompt_index,
                sample_index=s.sample_index,
                response=s.response,
                response_len=s.response_len,
                reward=reward,
                truncated=s.finish_reason == LENGTH_FINISH_REASON,
                weight_version=s.weight_version,
            )
            for s, reward in zip(mine, rewards, strict=True)
        ]
        return DatasetResult.from_scored(scored)
