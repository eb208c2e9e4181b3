"""Tiny Megatron-core GPTModels on CPU for tests (megatron-core 0.16.1, CPU torch, gloo).

Importing this module installs two process-wide CPU shims that megatron-core needs without CUDA:
`torch.cuda.current_device` returns the CPU device (rotary `inv_freq`, TP buffers) and
`torch.cuda.synchronize` is a no-op (dist_checkpointing save). Import it only in test processes.
The live export itself needs neither shim (it only all-gathers CPU tensors).

Families: llama (GQA, untied), qwen2 (QKV bias, tied embeddings), qwen3 (q/k layernorm,
head_dim != hidden/heads). Megatron's vocab is padded above the HF vocab so the exporter's slice
is exercised. Norm weights and biases are randomised so a wrong norm mapping cannot hide.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import random as tp_random  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3")
HF_VOCAB = 150
MCORE_VOCAB = 160  # padded, divisible by TP=2


@dataclass(frozen=True)
class FamilySpec:
    family: str
    hidden: int = 64
    heads: int = 4
    groups: int = 2
    head_dim: int = 16
    ffn: int = 128
    layers: int = 2
    qkv_bias: bool = False
    qk_layernorm: bool = False
    tied: bool = False


SPECS = {
    "llama": FamilySpec("llama"),
    "qwen2": FamilySpec("qwen2", qkv_bias=True, tied=True),
    "qwen3": FamilySpec("qwen3", head_dim=32, qk_layernorm=True),
}


def init_parallel(tp: int) -> None:
    """(Re)initialise Megatron's model-parallel state on an existing gloo process group."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    tracker = tp_random.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # dropout is 0: no CUDA RNG needed


def init_process_group(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)


def build_model(spec: FamilySpec, tp: int, seed: int = 1234, vocab: int = MCORE_VOCAB) -> GPTModel:
    """Same seed on every rank: CPU init builds the full master weight and each rank keeps its slice."""
    cfg = TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        num_query_groups=spec.groups, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_layernorm,
        tensor_model_parallel_size=tp, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    torch.manual_seed(seed)
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_layernorm)
    model = GPTModel(
        config=cfg, transformer_layer_spec=layer_spec, vocab_size=vocab, max_sequence_length=64,
        pre_process=True, post_process=True, share_embeddings_and_output_weights=spec.tied,
        parallel_output=False, position_embedding_type="rope", rotary_base=10000,
    )
    gen = torch.Generator().manual_seed(seed + 1)  # identical on every rank for replicated params
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or "layer_norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def forward(model: GPTModel, ids: torch.Tensor) -> torch.Tensor:
    """ids [b, s] -> logits [b, s, padded vocab] (explicit causal mask: the default builds it on CUDA)."""
    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos, attention_mask=mask)


def write_hf_base(spec: FamilySpec, dest: Path, vocab: int = HF_VOCAB) -> Path:
    """An HF base directory (config.json + generation_config.json) matching `spec`; no weights."""
    dest.mkdir(parents=True, exist_ok=True)
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    cfg = {
        "architectures": [arch[spec.family]], "model_type": spec.family, "vocab_size": vocab,
        "hidden_size": spec.hidden, "intermediate_size": spec.ffn, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.groups, "head_dim": spec.head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
        "tie_word_embeddings": spec.tied, "hidden_act": "silu", "torch_dtype": "float32",
        "attention_bias": spec.family == "llama" and spec.qkv_bias,
    }
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    (dest / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return dest


def save_torch_dist(model: GPTModel, ckpt_dir: Path) -> None:
    """Save `model` as a torch_dist checkpoint (collective; needs psutil, see module docstring)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), dp)
    dist_checkpointing.save(model.sharded_state_dict(), str(ckpt_dir), sharded_strategy=strategy)
