"""Tiny offline HF causal LMs for tests and demos, and perturbed copies of snapshots.

Contract:
- `make_tiny_model(out, arch, seed, ...)` writes a complete HF snapshot into `out`: `config.json`
  (with both `dtype` and `torch_dtype`), `generation_config.json`, safetensors weights (single file,
  or shards + `model.safetensors.index.json` when `max_shard_size` is given), and a byte-level BPE
  tokenizer trained offline on a fixed corpus (digits, arithmetic, short English words) with
  specials `<pad>`=0, `<s>`=1, `</s>`=2 and a chat template (`role: content` lines, or with
  `chat_template="chatml"` a Qwen-style ChatML Jinja template that also renders `tools`, assistant
  `tool_calls` and `tool` messages as Qwen2.5's does). Nothing is downloaded.
- The same (arch, seed, sizes) always gives the same tokenizer and the same weights.
- `tokenizer_config.json` names `PreTrainedTokenizerFast` (no `backend` key) so transformers 4.x
  readers load it too. Every file is mode 0644 (safetensors writes 0600). Caveat: for `qwen2`,
  transformers 5.x's AutoTokenizer picks `Qwen2Tokenizer` by model type, which splits digits its
  own way; the engine and the scorers both use AutoTokenizer, so they agree with each other.
- `perturb_snapshot(src, dst, seed)` writes a snapshot with the same file layout, tensor names,
  shapes and dtypes as `src` but different values (a "later training step"); non-weight files
  are copied as they are.
- `make_tiny_adapter(base, out, seed)` writes a seeded PEFT LoRA adapter (non-zero B) for `base`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

Arch = Literal["llama", "qwen2", "qwen3"]

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# A Qwen-style ChatML template (Jinja): `<|im_start|>role\ncontent<|im_end|>\n` per message, the
# assistant header as generation prompt, and Qwen3's `enable_thinking=False` empty think block.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Tools follow Qwen2.5's template: a system block listing `tools` as JSON, assistant tool calls as
# `<tool_call>\n{"name", "arguments"}\n</tool_call>`, tool results as a user `<tool_response>`.
CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools><|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
ChatTemplate = Literal["simple", "chatml"]
_WORDS = (  # noqa: SIM905 - one readable string
    "the a an and or not is are was be to of in on at for with as by it this that yes no true false "
    "one two three four five six seven eight nine ten zero plus minus times equals sum answer "
    "question number add subtract what how many cat dog red blue green big small hello world good "
    "bad up down left right day night sun moon tree water fire stone bird fish"
).split()


def _corpus() -> list[str]:
    """A fixed, order-stable training corpus for the BPE tokenizer."""
    lines: list[str] = [str(i) for i in range(200)]
    for a in range(0, 30, 3):
        for b in range(0, 30, 4):
            lines.append(f"{a}+{b}={a + b}")
            lines.append(f"{a}*{b}={a * b}")
            lines.append(f"{a + b}-{b}={a}")
    lines += [f"{w} {_WORDS[(i * 7) % len(_WORDS)]}" for i, w in enumerate(_WORDS)]
    lines += [f"What is {a} plus {b}? The answer is {a + b}." for a in range(10) for b in range(0, 10, 3)]
    lines.append(" ".join(_WORDS))
    return lines


def _train_tokenizer(
    vocab_size: int, model_max_length: int, chat_template: ChatTemplate = "simple"
):  # -> PreTrainedTokenizerFast
    from tokenizers import (  # tokenizers: only when a model is written
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast  # transformers: slow import, only when a model is written

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    chatml = chat_template == "chatml"
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS, *((IM_START, IM_END) if chatml else ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        model_max_length=model_max_length,
        chat_template=CHATML_TEMPLATE if chatml else CHAT_TEMPLATE,
        **({"additional_special_tokens": [IM_START, IM_END]} if chatml else {}),
    )


def _config(
    arch: Arch,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
):
    from transformers import (  # transformers: slow import, only when a model is written
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    head_dim = hidden_size // num_heads
    if arch == "llama":
        return LlamaConfig(**common, head_dim=head_dim, tie_word_embeddings=False)
    if arch == "qwen2":  # Qwen2 has q/k/v biases built in; small Qwen2 checkpoints tie embeddings
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":  # Qwen3 has per-head q/k RMSNorm built in
        return Qwen3Config(**common, head_dim=head_dim, tie_word_embeddings=False)
    raise ValueError(f"arch: unknown architecture {arch!r}; expected llama, qwen2 or qwen3")


def _patch_json(path: Path, update: dict, drop: tuple[str, ...] = ()) -> None:
    data = json.loads(path.read_text())
    data.update(update)
    for key in drop:
        data.pop(key, None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def make_tiny_model(
    out: Path,
    arch: Arch = "llama",
    seed: int = 0,
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 1024,
    max_shard_size: str | int | None = None,
    chat_template: ChatTemplate = "simple",
) -> Path:
    """Write a tiny HF causal LM snapshot + tokenizer into `out` (created if missing); return `out`.

    `chat_template="chatml"` gives the tokenizer a Qwen-style ChatML Jinja template (with
    `<|im_start|>`/`<|im_end|>` as special tokens 3 and 4) instead of the plain `role: content` one.
    """
    import torch  # torch: slow import, only when a model is written
    from transformers import (  # transformers: slow import, only when a model is written
        AutoModelForCausalLM,
        GenerationConfig,
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(min(vocab_size, 300), max_position_embeddings, chat_template)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"vocab_size: {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = _config(
        arch, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, max_position_embeddings
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(out, **save_kwargs)
    tokenizer.save_pretrained(out)
    _patch_json(out / "config.json", {"dtype": "float32", "torch_dtype": "float32"})
    _patch_json(
        out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"}, drop=("backend",)
    )
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)
    return out


def perturb_snapshot(src: Path, dst: Path, seed: int, scale: float = 0.5) -> Path:
    """Copy snapshot `src` to `dst` with every weight tensor changed by seeded noise; return `dst`.

    Each tensor t becomes t + scale * std(t) * noise (noise ~ N(0, 1) from `seed`); constant tensors
    (norm weights, all ones) get scale * noise. Names, shapes, dtypes and shard layout are kept.
    """
    import torch  # torch: slow import, only when a model is written
    from safetensors import safe_open  # safetensors/torch: only when a model is perturbed
    from safetensors.torch import save_file  # safetensors/torch: only when a model is perturbed

    from engine.weights import weight_files  # engine.weights imports torch

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    shards = set(weight_files(src))
    if not shards:
        raise FileNotFoundError(f"src: no safetensors files in {src}")
    for path in src.iterdir():
        if path.is_file() and path not in shards:
            shutil.copyfile(path, dst / path.name)
    gen = torch.Generator().manual_seed(seed)
    for shard in sorted(shards):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(shard, framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                t = f.get_tensor(name)
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
                std = float(t.float().std()) if t.numel() > 1 else 0.0
                tensors[name] = (
                    (t.float() + scale * (std if std > 0 else 1.0) * noise).to(t.dtype).contiguous()
                )
        save_file(tensors, dst / shard.name, metadata=metadata)
    for path in dst.iterdir():
        if path.is_file():
            path.chmod(0o644)
    return dst


def make_tiny_adapter(
    base: Path,
    out: Path,
    seed: int = 0,
    r: int = 4,
    lora_alpha: float = 8.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"),
    scale: float = 0.5,
) -> Path:
    """Write a PEFT-layout LoRA adapter for snapshot `base` into `out`; return `out`.

    Every linear weight whose module name ends in one of `targets` gets A `[r, in]` and B
    `[out, r]` drawn from `seed` (B non-zero, `scale` sets the size of the delta), saved as PEFT
    saves them (`adapter_config.json`, `adapter_model.safetensors` with
    `base_model.model.<module>.lora_{A,B}.weight`), so `peft.PeftModel.from_pretrained` loads it.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.weights import weight_files

    base, out = Path(base), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for shard in weight_files(base):
        with safe_open(shard, framework="pt") as f:
            for name in sorted(f.keys()):
                module = name.removesuffix(".weight")
                if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets:
                    continue
                rows, cols = f.get_slice(name).get_shape()
                prefix = f"base_model.model.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, cols, generator=gen) / cols**0.5
                tensors[f"{prefix}.lora_B.weight"] = scale * torch.randn(rows, r, generator=gen) / r**0.5
    if not tensors:
        raise ValueError(f"targets: no weight of {base} matches {targets}")
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "base_model_name_or_path": str(base), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "lora_alpha": lora_alpha, "lora_dropout": 0.0, "modules_to_save": None,
        "peft_type": "LORA", "r": r, "target_modules": sorted(targets), "task_type": "CAUSAL_LM",
        "use_dora": False, "use_rslora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in out.iterdir():
        path.chmod(0o644)
    return out
