"""Fleet block: the engines an eval point pins, attached by URL or launched by pinned-eval.

Invariants: control calls (load, read-back) go to each engine directly, data calls through the
router; `lora_mode` is here (not in the suite) because it is how the engines serve weights: an
adapter-mode SGLang fleet is launched with LoRA enabled and keeps the base resident; a launched
fleet keeps a state file so any process (a flow run, the janitor) can revive
its engines; the fleet's name names its pin lock, the global concurrency limit `fleet-<name>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, model_validator

from blocks._meta import DOCS_URL, LOGO_URL
from pinned_eval.fleet.client import FleetClient, FleetConfig
from pinned_eval.fleet.errors import FleetUnhealthy
from pinned_eval.fleet.launcher import LaunchedFleet, launch_cpu_fleet, launch_sglang_fleet
from pinned_eval.fleet.sglang_args import SGLangFleetSpec
from pinned_eval.points import BLOCK_NAME_PATTERN


class FleetBlock(Block):
    """An SGLang-protocol fleet (real SGLang on GPUs or CPU engines) behind sglang-router."""

    _block_type_name = "pinned-eval Fleet"
    _block_type_slug = "pinned-eval-fleet"
    _logo_url = LOGO_URL
    _documentation_url = DOCS_URL
    _description = "Engines an eval point pins to one verified weight version, attached or launched."
    _code_example = """
    from blocks import FleetBlock

    fleet = FleetBlock.load("BLOCK_NAME")
    print(fleet.name, fleet.mode)
    """

    name: str = Field(
        default="default",
        pattern=BLOCK_NAME_PATTERN,
        description="Fleet name; the pin lock is the global concurrency limit `fleet-<name>`.",
    )
    mode: Literal["attach", "launch"] = Field(
        default="launch",
        description="`attach`: use running engines at `engine_urls`; `launch`: pinned-eval started them.",
    )
    engine_urls: list[str] = Field(
        default_factory=list, description="Engine base URLs (attach mode; filled from the state file otherwise)."
    )
    router_url: str | None = Field(default=None, description="sglang-router base URL (attach mode).")
    state_file: str | None = Field(
        default=None,
        description="State file written by `pinned-eval fleet up` (launch mode): PIDs, ports, commands.",
    )
    backend: Literal["cpu", "sglang"] = Field(
        default="cpu", description="Engine kind for launch mode: the bundled CPU engine or real SGLang."
    )
    engines: int = Field(default=2, ge=1, le=256, description="Number of engines to launch.")
    gpus_per_engine: int = Field(default=1, ge=1, le=64, description="GPUs per SGLang engine (its TP size).")
    base_sglang_args: dict[str, Any] = Field(
        default_factory=dict, description="Base SGLang server arguments shared with the training fleet."
    )
    sglang_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Per-fleet SGLang argument overrides applied over the base arguments."
    )
    model_path: str | None = Field(
        default=None, description="Checkpoint launched engines boot from (launch mode); every pin reloads."
    )
    lora_mode: Literal["adapter", "merged"] = Field(
        default="adapter",
        description=(
            "How points with a LoRA source are served: `adapter` keeps the base weights and loads each "
            "adapter with /load_lora_adapter (SGLang needs --enable-lora, see `lora_max_rank`); `merged` "
            "merges adapter into base at export and pins the full snapshot."
        ),
    )
    lora_max_rank: int | None = Field(
        default=None, ge=1, description="Launch mode, SGLang: --enable-lora --max-lora-rank (adapter mode)."
    )
    lora_target_modules: list[str] = Field(
        default_factory=list, description="Launch mode, SGLang: --lora-target-modules (default: all)."
    )
    tool_call_parser: Literal["qwen25", "hermes"] | None = Field(
        default=None,
        description="Launch mode: SGLang's --tool-call-parser, so /v1/chat/completions replies carry tool_calls.",
    )
    request_concurrency: int = Field(
        default=32, ge=1, le=4096, description="Most generate requests in flight against this fleet."
    )
    load_timeout_s: float = Field(default=600.0, gt=0, description="Timeout of one weight load on one engine.")
    api_key: SecretStr | None = Field(
        default=None, description="Engines' API key (data plane); launch mode: generated when unset."
    )
    admin_api_key: SecretStr | None = Field(
        default=None, description="Engines' admin key (control plane); launch mode: generated when unset."
    )

    @model_validator(mode="after")
    def _attach_needs_urls(self) -> FleetBlock:
        if self.mode == "attach" and (not self.engine_urls or not self.router_url):
            raise ValueError("attach mode needs `engine_urls` and `router_url`")
        if self.mode == "launch" and not self.state_file:
            raise ValueError("launch mode needs `state_file` (written by `pinned-eval fleet up`)")
        return self

    @property
    def lock_name(self) -> str:
        return f"fleet-{self.name}"

    def state_path(self) -> Path | None:
        return Path(self.state_file) if self.state_file else None

    def client(self) -> FleetClient:
        """A fleet client over this fleet's engines; in launch mode it can revive dead engines."""

        config = FleetConfig(
            load_timeout_s=self.load_timeout_s,
            max_concurrency=self.request_concurrency,
            api_key=self.api_key.get_secret_value() if self.api_key else None,
            admin_api_key=self.admin_api_key.get_secret_value() if self.admin_api_key else None,
        )
        if self.mode == "attach":
            return FleetClient(self.engine_urls, self.router_url, config=config)
        state = Path(str(self.state_file))
        if not state.is_file():  # a typed skip naming the remedy, not a raw FileNotFoundError
            raise FleetUnhealthy(f"fleet {self.name!r} is not up: no state file {state}; start it with "
                                 f"`pinned-eval fleet up --model-path DIR --state-file {state}`")
        launched = LaunchedFleet.load(state, api_key=config.api_key)
        return launched.client(config)  # keys this block does not set come from the 0600 state file

    def launch(self, *, ready_timeout_s: float = 1800.0) -> LaunchedFleet:
        """Start this fleet (launch mode): `engines` CPU engines, or SGLang engines with
        `gpus_per_engine` GPUs each from `base_sglang_args` + `sglang_overrides`, behind
        sglang-router; the state file lets any process revive or stop them."""

        if self.mode != "launch" or not self.model_path:
            raise ValueError("launch: needs mode 'launch' and `model_path`")
        state = Path(str(self.state_file))
        api_key = self.api_key.get_secret_value() if self.api_key else None
        admin = self.admin_api_key.get_secret_value() if self.admin_api_key else None
        if self.backend == "cpu":
            return launch_cpu_fleet(
                self.model_path, self.engines, state_file=state, api_key=api_key, admin_api_key=admin,
                ready_timeout_s=ready_timeout_s, tool_call_parser=self.tool_call_parser,
            )
        spec = SGLangFleetSpec(
            model_path=self.model_path,
            num_gpus=self.engines * self.gpus_per_engine,
            gpus_per_engine=self.gpus_per_engine,
            base_args=self.base_sglang_args,
            overrides=self.sglang_overrides,
            lora_max_rank=self.lora_max_rank if self.lora_mode == "adapter" else None,
            lora_target_modules=self.lora_target_modules if self.lora_mode == "adapter" else [],
            tool_call_parser=self.tool_call_parser,
        )
        return launch_sglang_fleet(
            spec, log_dir=state.parent / "logs", state_file=state, api_key=api_key, admin_api_key=admin,
            ready_timeout_s=ready_timeout_s,
        )
