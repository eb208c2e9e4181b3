"""LoRA adapters on the CPU engine: the registry behind SGLang's `/load_lora_adapter` and
`/unload_lora_adapter` (routes in engine/control.py) and the per-row delta applied at forward time.

Contract (SGLang 0.5.23 `LoadLoRAAdapterReqInput` / `UnloadLoRAAdapterReqInput` / `LoRAUpdateOutput`):
- `POST /load_lora_adapter {lora_name, lora_path, pinned?}` → 200 `{success: true, error_message: "",
  loaded_adapters: {name: path}}`; a failure is 400 with `success: false` and `error_message`
  (the file and tensor at fault for a bad adapter). A name already loaded, or a path already
  loaded under another name, is refused as SGLang refuses it. The base weights never change.
- `POST /unload_lora_adapter {lora_name}` waits for in-flight requests (the weight-update write
  lock) and answers the same shape; an unknown name is 400.
- `/generate` names adapters with `lora_path` (an adapter *name*, SGLang's semantics): one string
  for the whole request or one entry (or null = base) per prompt of a batch; an unknown name is 400.
  Names are resolved under the read lock, so an unload never races a request that uses it.
- Loaded adapters are listed by `/v1/models` as cards `{id: name, root: path, parent: <model>}`.
- Math (PEFT's): for a target linear `y = W x`, a row using the adapter gets
  `y + scale * B (A x)`; rows of one batch may use different adapters or none.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

# The engine reads PEFT adapters itself, as SGLang does (it is a separate program: no project imports).
_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")


class AdapterError(ValueError):
    """A bad adapter or request; the message names the file (and tensor) at fault."""


@dataclass(frozen=True)
class LoraModule:
    """One target linear's delta `scale * B @ A` (A `[r, in]`, B `[out, r]`, float32)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def read_peft_adapter(root: Path, model: torch.nn.Module) -> dict[str, LoraModule]:
    """The adapter's modules, checked against the live model's linears (PEFT scaling, rsLoRA too)."""
    try:
        config = json.loads((root / "adapter_config.json").read_text())
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise AdapterError(f"adapter_config.json: unreadable in {root} ({err})") from None
    if config.get("use_dora"):
        raise AdapterError("adapter_config.json: use_dora: DoRA adapters are not supported")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    index = root / "adapter_model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    except (ValueError, KeyError, TypeError) as err:
        raise AdapterError(f"{index.name}: unreadable index ({err})") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for fname in files or ["adapter_model.safetensors"]:
        try:
            with safe_open(root / fname, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    m = _TENSOR.match(name)
                    if m is None:
                        raise AdapterError(f"{fname}: tensor {name} is not a LoRA A/B weight")
                    halves.setdefault(m["module"], {})[m["half"]] = f.get_tensor(name).float()
        except (SafetensorError, OSError) as err:
            raise AdapterError(f"{fname}: unreadable safetensors file ({err})") from None
    if not halves:
        raise AdapterError(f"adapter_model.safetensors: no LoRA tensors in {root}")
    linears = {n: mod for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    modules = {}
    for module, pair in sorted(halves.items()):
        a, b, target = pair.get("A"), pair.get("B"), linears.get(module)
        if a is None or b is None:
            raise AdapterError(f"adapter_model.safetensors: {module} lacks lora_A or lora_B")
        if target is None:
            raise AdapterError(f"adapter_model.safetensors: target {module} is not a linear layer of the model")
        if a.shape[0] != r or b.shape[1] != r or (b.shape[0], a.shape[1]) != tuple(target.weight.shape):
            raise AdapterError(
                f"adapter_model.safetensors: {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                f"do not fit the base's {list(target.weight.shape)} weight at rank {r}"
            )
        modules[module] = LoraModule(a=a, b=b, scale=scale)
    return modules


@dataclass(frozen=True, eq=False)
class Adapter:
    name: str
    path: str
    modules: dict[str, LoraModule]


class LoraHooks:
    """Forward hooks on target linears adding each row's adapter delta (model thread only)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self.rows: list[Adapter | None] = []  # the adapter of each row of the forward about to run
        self._hooked: set[str] = set()

    def load(self, name: str, path: str) -> Adapter:
        """Read, validate against the live model and register an adapter (raises `AdapterError`)."""
        if name in self.adapters:
            raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
        for other in self.adapters.values():
            if other.path == path:
                raise AdapterError(
                    f"{path} is already loaded with name: {other.name}, but another copy is being loaded "
                    f"with name: {name}"
                )
        if not Path(path).is_dir():
            raise AdapterError(f"lora_path: {path} is not a directory")
        modules = read_peft_adapter(Path(path), self.model)
        for module in modules:
            if module not in self._hooked:
                self.model.get_submodule(module).register_forward_hook(partial(self._hook, module))
                self._hooked.add(module)
        adapter = Adapter(name=name, path=path, modules=modules)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.adapters)}")
        del self.adapters[name]

    def loaded(self) -> dict[str, str]:
        return {a.name: a.path for a in list(self.adapters.values())}

    def _hook(self, module_name: str, module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
        rows = self.rows
        if not any(r is not None for r in rows):
            return None
        if len(rows) != output.shape[0]:  # the runner sets rows before every forward: a bug, never a skip
            raise RuntimeError(f"LoRA rows: {len(rows)} adapters for a batch of {output.shape[0]}")
        groups: dict[int, tuple[LoraModule, list[int]]] = {}
        for i, adapter in enumerate(rows):
            m = adapter.modules.get(module_name) if adapter is not None else None
            if m is not None:
                groups.setdefault(id(adapter), (m, []))[1].append(i)
        x = args[0]
        for m, idx in groups.values():
            if len(idx) == output.shape[0]:
                output = output + m.scale * ((x @ m.a.T) @ m.b.T)
            else:
                sel = torch.tensor(idx)
                output = output.index_add(0, sel, m.scale * ((x[sel] @ m.a.T) @ m.b.T))
        return output
