"""Tiny models of every family the trainer is verified on (each with its sliding window, soft
caps, fused projections), and a plain or packed batch: shared by the model-family tests and the
layer-scan tests."""

from __future__ import annotations

import json

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

from lora_logic.adapters import lora_modules
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora

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


def family_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny model of the family (fp32 unless told) with LoRA on every default target, B random
    (so both LoRA matrices get gradients), dropout 0."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[name]()).to(dtype)
    model.config.use_cache = False
    return with_family_lora(model, name)


def with_family_lora(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """`model` (of family `name`) with LoRA r 4 on the family's targets, B random, in training mode."""
    targets = TARGETS.get(name)
    inject_lora(model, LoraConfig(r=4, alpha=8, **({"target_modules": targets} if targets else {})))
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_B["default"].weight.normal_(std=0.05)
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


def reference_kernel(kind: str):
    """What splash / flash compute from their inputs, as documented (torch_xla 2.9 and JAX's
    splash masks): causal, same segment only, splash's LocalMask window (keys q - w .. q),
    splash's soft-cap, flash's sm_scale; [B, heads, L, D] in and out."""

    def attend(inputs: dict, mesh=None) -> torch.Tensor:
        q, k, v, segments = inputs["q"], inputs["k"], inputs["v"], inputs["segment_ids"]
        scores = q @ k.transpose(-1, -2) * inputs.get("sm_scale", 1.0)  # splash's q arrives scaled
        if inputs.get("soft_cap") is not None:
            scores = torch.tanh(scores / inputs["soft_cap"]) * inputs["soft_cap"]
        index = torch.arange(q.shape[2])
        allowed = (index[:, None] >= index[None, :]) & (segments[:, :, None] == segments[:, None, :])[:, None]
        if inputs.get("window") is not None:
            allowed = allowed & (index[None, :] >= index[:, None] - inputs["window"])
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    return attend


def reference_splash_ops():
    """torch_xla's splash op pair (`xla::sa_custom_forward` / `xla::sa_custom_backward`) as a
    reference with the same contract: forward(q, k, v, config_json, segment_ids, causal, soft_cap)
    -> (output, None, None), backward(grad, q, k, v, config_json, segment_ids, causal, soft_cap)
    -> (dq, dk, dv); the window read from the config as the kernel reads it."""
    attend = reference_kernel("splash")

    def inputs(q, k, v, config, segments, soft_cap):
        settings = json.loads(config)
        window = settings["slide_window_size"] if settings["attentiontype_local_sliding"] else None
        return {"q": q, "k": k, "v": v, "segment_ids": segments, "soft_cap": soft_cap, "window": window}

    def forward(q, k, v, config, segments, causal, soft_cap):
        assert causal
        return attend(inputs(q, k, v, config, segments, soft_cap)), None, None

    def backward(grad, q, k, v, config, segments, causal, soft_cap):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            output = attend(inputs(*leaves, config, segments, soft_cap))
            return torch.autograd.grad(output, leaves, grad)

    return forward, backward
