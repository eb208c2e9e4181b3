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

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pinned_eval.snapshot.lora import AdapterError, LoraModule, check_fits, read_adapter


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
        parsed = read_adapter(path)
        shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        check_fits(parsed, shapes)
        for module in parsed.modules:
            if not isinstance(self.model.get_submodule(module), torch.nn.Linear):
                raise AdapterError(f"adapter_model.safetensors: target {module} is not a linear layer")
        for module in parsed.modules:
            if module not in self._hooked:
                self.model.get_submodule(module).register_forward_hook(partial(self._hook, module))
                self._hooked.add(module)
        adapter = Adapter(name=name, path=path, modules=parsed.modules)
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
