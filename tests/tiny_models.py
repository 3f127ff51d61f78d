"""Tiny random models built in code (no hub): a byte-level BPE tokenizer trained on
a few sentences, and a Qwen3 with random fp32 weights, saved as a checkpoint
that both vLLM and HF transformers load."""

from __future__ import annotations

from pathlib import Path

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


def build_tiny_qwen3(folder: Path, layers: int = 3, max_positions: int = 512) -> str:
    """A small Qwen3 (hidden 128, head_dim 64: the CPU kernels need >= 64)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(folder)
    tokenizer = train_tokenizer(folder)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init, so activations are far from zero
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)
