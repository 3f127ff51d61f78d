"""Tiny random models built in code (no hub): a byte-level BPE tokenizer trained on
a few sentences, and a Qwen3 (dense, or a mixture of experts) with random fp32
weights, saved as a checkpoint that both vLLM and HF transformers load; and a
random LoRA adapter for one. For tests and for examples that need a model of a
shape SmolLM2 does not have (four attention heads split over two ranks)."""

from __future__ import annotations

import json
from pathlib import Path

from .smollm2 import cache_root

CORPUS = [
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "Berlin is the capital of Germany; Rome is the capital of Italy.",
    "A small model reads a short sentence and writes another one.",
    "Interpretability asks what each layer of a network computes.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Numbers like 1, 2, 3, 10, 42 and 1000 appear in many texts.",
]


def train_tokenizer(folder: Path, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(folder)
    return fast


def _random_checkpoint(folder: Path, config_class: type, model_class: type, **config) -> str:
    """A checkpoint of ``model_class`` with the small shape every tiny model here
    shares (hidden 128, head_dim 64: the CPU kernels need >= 64), random fp32
    weights, and the tokenizer above."""
    import torch

    folder = Path(folder)
    tokenizer = train_tokenizer(folder)
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        **config,
    )
    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init, so activations are far from zero
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def build_tiny_qwen3(folder: Path, layers: int = 3, max_positions: int = 512) -> str:
    """A small Qwen3."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _random_checkpoint(
        folder, Qwen3Config, Qwen3ForCausalLM, num_hidden_layers=layers, max_position_embeddings=max_positions
    )


def build_tiny_qwen3_moe(folder: Path, layers: int = 2, experts: int = 4) -> str:
    """A small Qwen3 mixture of experts: every layer's MLP is ``experts`` experts,
    two per token, with a router (``mlp.gate``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _random_checkpoint(
        folder,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        moe_intermediate_size=128,
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        num_hidden_layers=layers,
        max_position_embeddings=512,
    )


def build_lora_adapter(folder: Path, base: str, rank: int = 8, alpha: int = 16) -> str:
    """A random LoRA adapter (PEFT's layout) on ``base``'s ``q_proj`` and ``v_proj``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(base)
    widths = {
        "q_proj": config.num_attention_heads * config.head_dim,
        "v_proj": config.num_key_value_heads * config.head_dim,
    }
    generator = torch.Generator().manual_seed(7)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, width in widths.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = 0.2 * torch.randn(
                rank, config.hidden_size, generator=generator
            )
            tensors[f"{prefix}.lora_B.weight"] = 0.2 * torch.randn(width, rank, generator=generator)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(widths),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter))
    return str(folder)


def merged_lora(model, adapter: str) -> None:
    """Add an adapter's ``scale * B @ A`` into an HF model's weights, in place."""
    import torch
    from safetensors.torch import load_file

    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in tensors.items():
            if not key.endswith("lora_A.weight"):
                continue
            b = tensors[key.replace("lora_A", "lora_B")]
            path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            model.get_submodule(path).weight += scale * (b @ a)


def tiny_qwen3_path() -> str:
    """A tiny random Qwen3 (3 layers, hidden 128, 4 heads over 2 key/value heads),
    built once into the cache folder (``VLLM_NNSIGHT_CACHE``)."""
    folder = cache_root() / "tiny-qwen3"
    ready = folder / "vllm-nnsight-ready"
    if not ready.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        build_tiny_qwen3(folder)
        ready.write_text("ok")
    return str(folder)
