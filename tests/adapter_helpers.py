"""Adapters for the combination tests: three of one tiny Llama base, and what PEFT's
add_weighted_adapter makes of them (PEFT is a test-only dependency). In float64: PEFT's
combinations and ours are equal in exact arithmetic, not in rounding (tests/tolerances.py)."""

from __future__ import annotations

import torch
from conftest import tiny_causal_lm

from lora_logic.adapter_io import save_adapters
from lora_logic.adapters import lora_parameters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora

BASE = "tiny-llama"
# Two adapters of rank 4 with other scalings and partly other targets (v_proj: a1 only, o_proj:
# a2 only), and one of rank 8.
CONFIGS = {"a1": LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]),
           "a2": LoraConfig(r=4, alpha=16, target_modules=["q_proj", "o_proj"]),
           "a3": LoraConfig(r=8, alpha=8, target_modules=["q_proj", "v_proj"])}
DTYPE = torch.float64


def write_random_adapters(root):
    """Each of CONFIGS saved under root/<name>, with random A and B; returns root."""
    for seed, (name, config) in enumerate(CONFIGS.items()):
        model = tiny_causal_lm("llama").to(DTYPE)
        inject_lora(model, config)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in lora_parameters(model):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        save_adapters(model, root / name, config, BASE)
    return root


def peft_combined(root, names, weights, method, **options):
    """PEFT's combined adapter "c": (its config, {module: (A, B)}), and the PEFT model."""
    import peft

    model = peft.PeftModel.from_pretrained(tiny_causal_lm("llama").to(DTYPE), root / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(root / name, adapter_name=name)
    model.add_weighted_adapter(list(names), list(weights), "c", combination_type=method, **options)
    modules = {}
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "c" in module.lora_A:
            modules[name] = (module.lora_A["c"].weight.detach(), module.lora_B["c"].weight.detach())
    return model.peft_config["c"], modules, model
