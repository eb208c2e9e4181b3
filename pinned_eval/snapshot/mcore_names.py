"""Megatron-core GPT (dense) → Hugging Face names and tensor layouts: Llama, Qwen2, Qwen3.

Pure tensor code: no megatron import, no I/O, no process group. Both export paths (live model,
offline `torch_dist` checkpoint) feed full (TP-merged, per-layer) Megatron tensors through
`MegatronToHf.convert`, which returns HF tensors.

Invariants:
- names are accepted with any number of leading `module.` wrappers (DDP, Float16Module) and with
  either norm naming: local spec (`input_layernorm`, `pre_mlp_layernorm`) or Transformer Engine /
  torch_dist (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`);
- fused QKV rows are ordered per KV group (`[q_0..q_{r-1}, k, v]` for each group) and are
  de-interleaved; the fused SwiGLU fc1 is `[gate; up]` (after TP regrouping, see trainer_integration);
- embeddings and the output layer are sliced to the HF `vocab_size` (Megatron pads the vocab);
- `hf_tensor_names(layout)` is exactly the set of HF parameters the architecture expects (tied
  `lm_head` excluded); the exporters pass it to the writer as the plan, so every HF tensor is
  produced exactly once or the export fails;
- `_extra_state` entries are skipped; any other unknown model name raises `UnmappedTensor`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError, model_validator

from pinned_eval.snapshot.errors import ConversionError, ExportError

Family = Literal["llama", "qwen2", "qwen3"]
FAMILIES: tuple[str, ...] = get_args(Family)
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


class UnmappedTensor(ExportError, KeyError):
    """A Megatron model tensor this converter has no HF mapping for (never silently dropped)."""


class HfDenseConfig(BaseModel):
    """The fields of an HF `config.json` the conversion depends on (validated at the edge)."""

    model_config = ConfigDict(extra="ignore")

    model_type: str
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    vocab_size: PositiveInt
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @model_validator(mode="after")
    def _heads_divide(self) -> HfDenseConfig:
        kv = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % kv:
            raise ConversionError(
                f"num_key_value_heads={kv} must divide num_attention_heads={self.num_attention_heads}"
            )
        if self.mlp_bias:
            raise ConversionError("mlp_bias=True is not supported (Llama/Qwen dense MLPs have no bias)")
        return self


@dataclass(frozen=True)
class DenseLayout:
    """Shapes and options of one dense Llama/Qwen2/Qwen3 model, in HF terms."""

    family: Family
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], family: str | None = None) -> DenseLayout:
        """Validate `config` (a parsed config.json); `family` overrides the `model_type` inference."""
        try:
            cfg = HfDenseConfig.model_validate(dict(config))
        except ValidationError as exc:
            raise ConversionError(f"HF config.json is not a dense Llama/Qwen config: {exc}") from exc
        fam = family or cfg.model_type
        if fam not in FAMILIES:
            raise ConversionError(
                f"model_type={cfg.model_type!r} is not one of {FAMILIES}; pass family= to override"
            )
        return cls(
            family=fam,  # type: ignore[arg-type]
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads,
            vocab_size=cfg.vocab_size,
            tied=cfg.tie_word_embeddings,
            qkv_bias=fam == "qwen2" or cfg.attention_bias,  # Qwen2 always has q/k/v bias
            o_bias=fam != "qwen2" and cfg.attention_bias,
            qk_norm=fam == "qwen3",
        )

    @property
    def qkv_rows(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


def hf_tensor_shapes(layout: DenseLayout) -> dict[str, tuple[int, ...]]:
    """Every HF parameter name → shape, in the HF module order (tied lm_head excluded)."""
    h, d = layout.hidden_size, layout.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (layout.vocab_size, h)}
    for i in range(layout.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        for proj, rows in (("q", layout.num_heads * d), ("k", layout.num_kv_heads * d),
                           ("v", layout.num_kv_heads * d)):
            out[p + f"self_attn.{proj}_proj.weight"] = (rows, h)
            if layout.qkv_bias:
                out[p + f"self_attn.{proj}_proj.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (h, layout.num_heads * d)
        if layout.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if layout.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (layout.intermediate_size, h)
        out[p + "mlp.up_proj.weight"] = (layout.intermediate_size, h)
        out[p + "mlp.down_proj.weight"] = (h, layout.intermediate_size)
    out["model.norm.weight"] = (h,)
    if not layout.tied:
        out["lm_head.weight"] = (layout.vocab_size, h)
    return out


def strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def split_qkv(fused: torch.Tensor, layout: DenseLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full fused QKV weight `[(h+2g)·d, H]` (or bias `[(h+2g)·d]`) → (q, k, v) in HF layout."""
    g, d = layout.num_kv_heads, layout.head_dim
    r = layout.num_heads // g
    if fused.shape[0] != layout.qkv_rows:
        raise ConversionError(
            f"linear_qkv has {fused.shape[0]} rows, expected (heads + 2·kv_heads)·head_dim = "
            f"{layout.qkv_rows}"
        )
    tail = fused.shape[1:]
    q, k, v = fused.reshape(g, r + 2, d, *tail).split([r, 1, 1], dim=1)
    return q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(), v.reshape(-1, *tail).contiguous()


class MegatronToHf:
    """Converts full Megatron tensors to HF tensors for one layout.

    `source_tied`: the Megatron model shares embedding and output weights (no `output_layer.weight`
    in its state). If the HF config is untied, the embedding is also written as `lm_head.weight`
    (a clone: safetensors rejects shared storage). An untied source with a tied HF config raises.
    """

    def __init__(self, layout: DenseLayout, *, source_tied: bool) -> None:
        self.layout = layout
        self.source_tied = source_tied

    def _vocab(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] < self.layout.vocab_size:
            raise ConversionError(
                f"{name} has {t.shape[0]} rows, fewer than HF vocab_size={self.layout.vocab_size}"
            )
        return t[: self.layout.vocab_size]

    def convert(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        name = strip_wrappers(name)
        if name.endswith("_extra_state"):
            return []
        if name == "embedding.word_embeddings.weight":
            emb = self._vocab(name, t)
            out = [("model.embed_tokens.weight", emb)]
            if self.source_tied and not self.layout.tied:
                out.append(("lm_head.weight", emb.clone()))
            return out
        if name == "output_layer.weight":
            if self.layout.tied:
                raise ConversionError(
                    "HF config has tie_word_embeddings=true but the Megatron model has its own "
                    "output_layer.weight; set tie_word_embeddings=false in the base HF config"
                )
            return [("lm_head.weight", self._vocab(name, t))]
        if name == "decoder.final_layernorm.weight":
            return [("model.norm.weight", t)]
        m = _LAYER.match(name)
        if not m:
            raise UnmappedTensor(name)
        prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest in _SIMPLE:
            return [(prefix + _SIMPLE[rest], t)]
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = split_qkv(t, self.layout)
            return [(prefix + f"self_attn.{n}_proj.{kind}", x) for n, x in zip("qkv", (q, k, v), strict=True)]
        if rest == "mlp.linear_fc1.weight":
            if t.shape[0] != 2 * self.layout.intermediate_size:
                raise ConversionError(
                    f"{name} has {t.shape[0]} rows, expected 2·intermediate_size = "
                    f"{2 * self.layout.intermediate_size} (SwiGLU [gate; up])"
                )
            gate, up = t.chunk(2, dim=0)
            return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
        raise UnmappedTensor(name)


def plan_conversion(
    converter: MegatronToHf, sources: list[tuple[str, torch.Size, torch.dtype]]
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Run `converter` on meta tensors of the full Megatron `sources` (name, shape, dtype) and check
    the result is exactly the HF architecture's parameters (`hf_tensor_shapes`): no tensor missing,
    none extra or produced twice, every shape right. Returns (hf_name, shape, dtype) in production
    order, before any data is read or gathered."""
    expected = hf_tensor_shapes(converter.layout)
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    seen: dict[str, str] = {}
    for name, shape, dtype in sources:
        for hf_name, t in converter.convert(name, torch.empty(shape, dtype=dtype, device="meta")):
            if hf_name not in expected:
                family = converter.layout.family
                raise ConversionError(f"{name} → {hf_name}, which the HF {family} config does not have")
            if hf_name in seen:
                raise ConversionError(f"{hf_name} is produced twice (from {seen[hf_name]} and {name})")
            if tuple(t.shape) != expected[hf_name]:
                raise ConversionError(
                    f"{name} → {hf_name} has shape {tuple(t.shape)}, "
                    f"the HF config expects {expected[hf_name]}"
                )
            seen[hf_name] = name
            out.append((hf_name, tuple(t.shape), t.dtype))
    missing = [n for n in expected if n not in seen]
    if missing:
        raise ConversionError(f"{len(missing)} HF tensors have no Megatron source, e.g. {missing[:3]}")
    return out
