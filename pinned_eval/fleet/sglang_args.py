"""Real SGLang engine commands for a GPU fleet: base server args + per-fleet overrides.

Rules (miles `_apply_eval_model_config`, reference miles-eval §8):
- Precedence, last wins: base args (e.g. the training fleet's `--sglang-*`) < eval defaults
  < the fleet's TP (`tp_size = gpus_per_engine`) < per-fleet overrides.
- Eval defaults switch off replay side channels (`enable_return_routed_experts`,
  `enable_return_indexer_topk`): useless for eval.
- When the fleet's TP differs from the base TP, the TP-coupled sizes `dp_size`, `pp_size`,
  `ep_size`, `attn_cp_size` fall back to 1 (inheriting them across a different TP makes SGLang
  refuse to boot); an override still wins over that fallback. With equal TP they are inherited.
- `tp_size` cannot be overridden (it comes from `gpus_per_engine`), nor can the launcher-owned
  keys (host, port, GPU placement, multi-node); those are dropped from the base.
- The base mapping is never mutated. Keys are ServerArgs field names; a flag is `--` + the name
  with `_` turned into `-`. True booleans become bare flags, False and None are left out, lists
  become repeated values, dicts JSON.
- LoRA adapter mode (`lora_max_rank` set): `--enable-lora --max-lora-rank N --lora-target-modules
  <modules|all>` after the TP and before the overrides (SGLang sizes its LoRA buffers at launch;
  adapters are loaded later with /load_lora_adapter, so no `--lora-paths`).
- Engine i gets `CUDA_VISIBLE_DEVICES` = its own `gpus_per_engine` consecutive GPU ids.
- Keys never go on the command line (visible in `ps`): `api_key`, `admin_api_key` and `config`
  are launcher-owned (dropped from the base, refused in overrides); the launcher writes them to a
  0600 YAML file (`fleet.keys.write_sglang_key_config`) and the command carries only
  `--config <file>` (SGLang's `prepare_server_args` merges it in-process; only one `--config`).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pinned_eval.processes import ProcessSpec

log = logging.getLogger(__name__)

TP_COUPLED_SIZES = ("dp_size", "pp_size", "ep_size", "attn_cp_size")
EVAL_DEFAULTS: dict[str, Any] = {"enable_return_routed_experts": False, "enable_return_indexer_topk": False}
LAUNCHER_OWNED = frozenset(
    {"host", "port", "base_gpu_id", "gpu_id_step", "nnodes", "node_rank", "dist_init_addr", "nccl_port"}
    | {"api_key", "admin_api_key", "config"}  # keys: a 0600 --config file, never argv
)
_FIELD = re.compile(r"^[a-z][a-z0-9_]*$")


class SGLangFleetSpec(BaseModel):
    """A fleet of real SGLang engines on one host's GPUs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str = Field(min_length=1, description="Checkpoint the engines boot from; every pin reloads.")
    num_gpus: int = Field(ge=1, description="GPUs of the whole fleet.")
    gpus_per_engine: int = Field(default=1, ge=1, description="GPUs per engine = its TP size.")
    base_args: dict[str, Any] = Field(default_factory=dict, description="Base ServerArgs fields.")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Per-fleet ServerArgs overrides.")
    gpu_ids: list[int] | None = Field(default=None, description="Physical GPU ids; default 0..num_gpus-1.")
    weight_version: str | None = Field(default=None, description="`--weight-version` at boot.")
    lora_max_rank: int | None = Field(
        default=None, ge=1, description="Adapter mode: `--enable-lora --max-lora-rank N` (None: LoRA off)."
    )
    lora_target_modules: list[str] = Field(
        default_factory=list, description="Adapter mode: `--lora-target-modules` (empty: `all`)."
    )
    host: str = "127.0.0.1"
    python: str = Field(default=sys.executable, description="Interpreter that has sglang installed.")

    @model_validator(mode="after")
    def _check(self) -> SGLangFleetSpec:
        if self.num_gpus % self.gpus_per_engine:
            raise ValueError(
                f"num_gpus ({self.num_gpus}) must be a multiple of gpus_per_engine ({self.gpus_per_engine})"
            )
        if "tp_size" in self.overrides:
            raise ValueError("overrides.tp_size: TP comes from gpus_per_engine and cannot be overridden")
        owned = sorted((LAUNCHER_OWNED | {"model_path"}) & self.overrides.keys())
        if owned:
            raise ValueError(f"overrides.{owned[0]}: set by the launcher, not by overrides")
        for where, args in (("base_args", self.base_args), ("overrides", self.overrides)):
            for key in args:
                if not _FIELD.fullmatch(key):
                    raise ValueError(f"{where}.{key}: not a ServerArgs field name (snake_case)")
        if self.lora_target_modules and self.lora_max_rank is None:
            raise ValueError("lora_target_modules: needs lora_max_rank (adapter mode enables LoRA)")
        if self.gpu_ids is not None and len(self.gpu_ids) != self.num_gpus:
            raise ValueError(f"gpu_ids: {len(self.gpu_ids)} ids for num_gpus={self.num_gpus}")
        return self

    @property
    def num_engines(self) -> int:
        return self.num_gpus // self.gpus_per_engine


def resolve_server_args(spec: SGLangFleetSpec) -> dict[str, Any]:
    """The ServerArgs fields every engine of the fleet gets (host and port excluded)."""
    args = {k: v for k, v in spec.base_args.items() if k not in LAUNCHER_OWNED}
    base_tp = int(args.get("tp_size", 1))
    args.update(EVAL_DEFAULTS)
    if base_tp != spec.gpus_per_engine:
        reset = [k for k in TP_COUPLED_SIZES if k in args and args[k] != 1]
        if reset:
            log.info("fleet TP %d != base TP %d: %s fall back to 1", spec.gpus_per_engine, base_tp, reset)
        for key in TP_COUPLED_SIZES:
            if key in args:
                args[key] = 1
    args["tp_size"] = spec.gpus_per_engine
    args["model_path"] = spec.model_path
    if spec.weight_version is not None:
        args["weight_version"] = spec.weight_version
    if spec.lora_max_rank is not None:  # adapters are loaded per point: none at boot (no --lora-paths)
        args["enable_lora"] = True
        args["max_lora_rank"] = spec.lora_max_rank
        args["lora_target_modules"] = list(spec.lora_target_modules) or ["all"]
    args.update(spec.overrides)
    return args


def server_args_to_cli(args: dict[str, Any]) -> list[str]:
    """`--flag value` list for `python -m sglang.launch_server`, `--model-path` first."""
    out: list[str] = []
    ordered = sorted(args.items(), key=lambda kv: (kv[0] != "model_path", kv[0]))
    for key, value in ordered:
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, sort_keys=True)]
        else:
            out += [flag, str(value)]
    return out


def sglang_engine_specs(
    spec: SGLangFleetSpec, ports: list[int], *, key_config: Path | None = None
) -> list[ProcessSpec]:
    """One `ProcessSpec` per engine: same server args, own port, own GPUs; `key_config` (the 0600
    YAML with the keys) is passed as `--config`."""
    if len(ports) != spec.num_engines:
        raise ValueError(f"ports: {len(ports)} given for {spec.num_engines} engines")
    gpu_ids = spec.gpu_ids if spec.gpu_ids is not None else list(range(spec.num_gpus))
    cli = server_args_to_cli(resolve_server_args(spec))
    if key_config is not None:
        cli += ["--config", str(key_config)]
    specs = []
    for i, port in enumerate(ports):
        gpus = gpu_ids[i * spec.gpus_per_engine : (i + 1) * spec.gpus_per_engine]
        command = [spec.python, "-m", "sglang.launch_server", *cli, "--host", spec.host, "--port", str(port)]
        specs.append(
            ProcessSpec(
                role="engine",
                command=command,
                env={"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)},
                port=port,
                host=spec.host,
            )
        )
    return specs
