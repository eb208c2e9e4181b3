"""Sequences and the left-padded KV-cache batch they are decoded in.

Contract and invariants:
- `Sequence` is one generation (one copy of one prompt). Once submitted it is mutated only on
  the model thread; other threads may only set `abort_message` (under the runner's lock).
- `KVBatch` holds rows that share one transformers `DynamicCache` and one attention mask
  `[rows, width]`, left-padded. Row invariant: the cache holds every token of a row except its
  last output token, which is the next decode input.
- `prefill(seqs)` runs prompt + output-so-far of the newcomers together, then merges their cache
  into the batch, left-padding whichever side is shorter; it returns the newcomers' last-position
  logits. `step()` feeds every row's last token once. `keep(indices)` drops the other rows and
  trims columns that are padding in every remaining row. Positions come from the mask
  (`cumsum - 1`), so padding never shifts a row's rotary positions.
"""

from __future__ import annotations

import inspect
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.protocol import LogprobSpec, SamplingParams

Top = list[tuple[float, int]]  # (logprob, token id), best first


@dataclass
class Logprobs:
    """Raw logprobs of one sequence (token texts are added at the HTTP edge, see engine/logprobs.py).

    `input_*` cover the prompt from `start_len` on; their first entry has no logprob (None), as in
    SGLang. `output_*` have one entry per output token."""

    spec: LogprobSpec
    input_token: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[Top | None] = field(default_factory=list)
    output_token: list[tuple[float, int]] = field(default_factory=list)
    output_top: list[Top] = field(default_factory=list)
    input_done: bool = False


@dataclass(frozen=True)
class SeqResult:
    rid: str
    text: str
    output_ids: list[int]
    finish_reason: dict
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    weight_versions: list[dict] | None
    num_retractions: int
    e2e_latency: float
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: Logprobs | None = None


@dataclass(eq=False)
class Sequence:
    """One generation; `future` resolves to its `SeqResult`."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    internal: bool = False  # health probes: not counted in stats or load
    lora_name: str | None = None  # the adapter named by the request's `lora_path`
    lora: Any = None  # its `engine.lora.Adapter`, resolved under the read lock
    logprobs: Logprobs | None = None  # None: the request did not ask for logprobs
    script: list[int] | None = None  # scripted decoding (engine/scripted.py): the tokens to emit
    output_ids: list[int] = field(default_factory=list)
    abort_message: str | None = None
    finish: dict | None = None
    spans: list[list[Any]] = field(default_factory=list)  # [version, start, end) over output tokens
    num_retractions: int = 0
    created: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)
    generator: torch.Generator | None = None

    def record_token(self, token: int, version: str) -> None:
        index = len(self.output_ids)
        self.output_ids.append(token)
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = index + 1
        else:
            self.spans.append([version, index, index + 1])


def check_cache_support(model: torch.nn.Module) -> str:
    """The forward kwarg naming the KV cache; raises if the model needs non-dynamic cache layers."""
    from transformers import DynamicCache  # transformers: slow import, only when a model is loaded
    from transformers.cache_utils import DynamicLayer  # transformers: slow import, only when a model is loaded

    probe = DynamicCache(config=getattr(model, "config", None))
    if any(type(layer) is not DynamicLayer for layer in probe.layers):
        raise ValueError("model: sliding-window or hybrid attention caches are not supported")
    # transformers 5.24 renamed the forward kwarg/output `past_key_values` to `cache`.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _left_pad(t: torch.Tensor, width: int, seq_dim: int) -> torch.Tensor:
    missing = width - t.shape[seq_dim]
    if missing == 0:
        return t
    dims_after = t.dim() - 1 - (seq_dim % t.dim())
    return F.pad(t, (0, 0) * dims_after + (missing, 0))


class KVBatch:
    """Rows decoding together over one left-padded KV cache (model thread only)."""

    def __init__(self, model: torch.nn.Module, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        self.cache_kw = check_cache_support(model)
        self.rows: list[Sequence] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def clear(self) -> list[Sequence]:
        rows, self.rows, self.cache, self.mask = self.rows, [], None, None
        return rows

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Add `seqs` to the batch; return their next-token logits `[len(seqs), vocab]`."""
        tokens = [s.prompt_ids + s.output_ids for s in seqs]
        width = max(len(t) for t in tokens)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, width - len(t) :] = torch.tensor(t, dtype=torch.long)
            mask[i, width - len(t) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
            )
        self._merge(seqs, getattr(out, self.cache_kw), mask)
        return out.logits[:, -1, :]

    def full_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits at every position of one token sequence `[len(ids), vocab]` (no cache kept):
        the prompt logprobs of a request that asked for them."""
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            out = self.model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
        return out.logits[0]

    def _merge(self, seqs: list[Sequence], cache: Any, mask: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask = list(seqs), cache, mask
            return
        assert self.mask is not None
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width, -2), _left_pad(new.keys, width, -2)], dim=0)
            old.values = torch.cat([_left_pad(old.values, width, -2), _left_pad(new.values, width, -2)], dim=0)
        self.mask = torch.cat([_left_pad(self.mask, width, -1), _left_pad(mask, width, -1)], dim=0)
        self.rows.extend(seqs)

    def step(self) -> torch.Tensor:
        """Feed every row's last output token; return next-token logits `[rows, vocab]`."""
        assert self.mask is not None and self.rows
        inputs = torch.tensor([[s.output_ids[-1]] for s in self.rows], dtype=torch.long)
        self.mask = torch.cat([self.mask, torch.ones((len(self.rows), 1), dtype=torch.long)], dim=1)
        positions = self.mask.sum(-1, keepdim=True) - 1
        with torch.inference_mode():
            out = self.model(
                input_ids=inputs,
                attention_mask=self.mask,
                position_ids=positions,
                use_cache=True,
                **{self.cache_kw: self.cache},
            )
        self.cache = getattr(out, self.cache_kw)
        return out.logits[:, -1, :]

    def keep(self, indices: list[int]) -> None:
        """Keep only the rows at `indices` (in that order)."""
        if len(indices) == len(self.rows):
            return
        if not indices:
            self.clear()
            return
        assert self.mask is not None
        index = torch.tensor(indices, dtype=torch.long)
        mask = self.mask[index]
        start = int(torch.nonzero(mask.any(dim=0))[0])  # columns padded in every row go
        self.mask = mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, start:, :]
            layer.values = layer.values[index, :, start:, :]
        self.rows = [self.rows[i] for i in indices]
