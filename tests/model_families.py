"""Tiny models of every family the trainer is verified on (each with its sliding window, soft
caps, fused projections), and a plain or packed batch: shared by the model-family tests and the
layer-scan tests."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from lora_logic import LoraConfig, inject_lora, lora_modules

VOCAB, LENGTH, WINDOW = 96, 32, 6
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
FAMILIES = {
    "mistral": lambda: MistralConfig(**SHAPE, sliding_window=WINDOW),
    "llama": lambda: LlamaConfig(**SHAPE),
    "qwen2": lambda: Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": lambda: Qwen3Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "gemma2": lambda: Gemma2Config(**SHAPE, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=3.0),
    "gemma3": lambda: Gemma3TextConfig(**SHAPE, sliding_window=WINDOW,
                                       layer_types=["sliding_attention", "full_attention"]),
    "phi3": lambda: Phi3Config(**SHAPE, sliding_window=WINDOW, pad_token_id=0),
}
# Phi-3 fuses q/k/v and gate/up into single projections.
TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
SLIDING = {"mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"}


def family_model(name: str) -> torch.nn.Module:
    """A tiny fp32 model of the family with LoRA on every default target, B random (so both
    LoRA matrices get gradients), dropout 0."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[name]()).float()
    model.config.use_cache = False
    targets = TARGETS.get(name)
    inject_lora(model, LoraConfig(r=4, alpha=8, **({"target_modules": targets} if targets else {})))
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_B.weight.normal_(std=0.05)
    return model.train()


def batch(packed: bool) -> dict[str, torch.Tensor]:
    """Two rows of LENGTH tokens; packed rows hold samples of 11, 13 and 8 tokens (and 20, 12),
    each with its first 3 tokens masked out of the loss, as phase 2's prompts are."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, VOCAB, (2, LENGTH), generator=generator)
    labels = input_ids.clone()
    positions = torch.arange(LENGTH).repeat(2, 1)
    if packed:
        for row, lengths in enumerate(([11, 13, 8], [20, 12])):
            start = 0
            for length in lengths:
                positions[row, start:start + length] = torch.arange(length)
                labels[row, start:start + 3] = -100
                start += length
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions}
