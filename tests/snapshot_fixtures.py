"""Helpers for the snapshot tests: tensors to write, a tiny offline HF base model, logits.

The tiny model comes from `engine.tiny_model.make_tiny_model` when it is installed; otherwise a
Llama config of the same size is built here with transformers directly (no tokenizer files).
"""

from __future__ import annotations

from pathlib import Path

import torch


def named_tensors(seed: int = 0, n: int = 6) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and shapes, including a scalar, a bool and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    out = [(f"layers.{i}.weight", torch.randn(64, 48, generator=g)) for i in range(n)]
    out += [
        ("norm.weight", torch.randn(48, generator=g).to(torch.bfloat16)),
        ("mask", torch.rand(5, generator=g) > 0.5),
        ("scale", torch.tensor(3.5, dtype=torch.float16)),
        ("empty", torch.zeros(0, 4)),
        ("ids", torch.arange(7, dtype=torch.int64)),
    ]
    return out


def tiny_hf_base(out: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A tiny HF causal LM dir (config, weights, tokenizer when available)."""
    try:
        from engine.tiny_model import make_tiny_model
    except ImportError:
        make_tiny_model = None
    if make_tiny_model is not None:
        return make_tiny_model(out, arch=arch, seed=seed)  # type: ignore[arg-type]
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg = Qwen2Config(**common, tie_word_embeddings=True) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def logits(model_dir: str | Path, seed: int = 0) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


def perturbed_state_dict(model_dir: str | Path, seed: int) -> dict[str, torch.Tensor]:
    """The model's own state dict (tied weights once) with seeded noise: a 'later training step'."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():  # named_parameters lists a tied weight once
        out[name] = (p.detach() + 0.1 * torch.randn(p.shape, generator=g)).contiguous()
    return out
