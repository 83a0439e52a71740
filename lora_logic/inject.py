"""Find the target `nn.Linear` layers of a model by name suffix and wrap them in `LoRALinear`."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lora_logic.config import LoraConfig
from lora_logic.layer import LoRALinear
from lora_logic.layer_scan import ScannedLayers


def matches_target(module_name: str, target: str) -> bool:
    """PEFT's suffix rule: "q_proj" matches "q_proj" and "model.layers.0.self_attn.q_proj",
    not "model.layers.0.self_attn.xq_proj"."""
    return module_name == target or module_name.endswith("." + target)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(name, module) for every LoRALinear in `model`, in `named_modules()` order.

    Scanned decoder layers (layer_scan.py) hold their LoRA weights stacked, in no LoRALinear:
    a model with them is refused here, so injecting, loading and merging (which go through
    this) say so instead of finding no LoRA; `lora_parameters` and `lora_state_dict` read them."""
    for name, module in model.named_modules():
        if isinstance(module, ScannedLayers):
            raise ValueError(f"{name}: the decoder layers are scanned (lora_logic/layer_scan.py), their LoRA weights "
                             "stacked; inject, load or merge adapters before scan_decoder_layers")
        if isinstance(module, LoRALinear):
            yield name, module


def inject_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Wrap every `nn.Linear` whose name ends with one of `config.target_modules`.

    Freezes every parameter of `model`, then makes only the new `lora_A`/`lora_B` weights
    trainable. Returns the wrapped module names. Raises `ValueError` when a target matches no
    `nn.Linear` (listing the Linear names that do exist) and when `model` already has LoRA.
    """
    existing = [name for name, _ in lora_modules(model)]
    if existing:
        raise ValueError(
            f"model already has {len(existing)} LoRA layers (e.g. {existing[0]!r}); "
            "inject_lora must be called once per model (load a fresh base, or merge and re-load)"
        )
    linear_names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    to_wrap = [name for name in linear_names if any(matches_target(name, t) for t in config.target_modules)]
    unmatched = [t for t in config.target_modules if not any(matches_target(n, t) for n in to_wrap)]
    if unmatched:
        leaf_names = sorted({name.rsplit(".", 1)[-1] for name in linear_names})
        raise ValueError(
            f"lora.target_modules {unmatched} match no nn.Linear in {type(model).__name__}. "
            f"Linear layer names in this model: {leaf_names}. Fix lora.target_modules."
        )

    for param in model.parameters():
        param.requires_grad_(False)
    for salt, name in enumerate(to_wrap):
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child_name)
        wrapped = LoRALinear(
            base,
            r=config.r,
            alpha=config.alpha,
            dropout=config.dropout,
            use_rslora=config.use_rslora,
            dropout_salt=salt,  # each layer its own dropout masks
        )
        # New modules start in training mode; keep the model's mode (no live dropout in eval).
        wrapped.train(base.training)
        setattr(parent, child_name, wrapped)
    return to_wrap


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable LoRA weights (A then B of each layer), the only thing the optimizer sees.
    Scanned layers (layer_scan.py) hold theirs stacked: one [layers, ...] tensor per target's A and B."""
    params = []
    for _, module in model.named_modules():
        if isinstance(module, LoRALinear):
            params += [module.lora_A.weight, module.lora_B.weight]
        elif isinstance(module, ScannedLayers):
            params += module.lora_parameters()
    return params


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """{"<module path>.lora_A.weight": [r, in], "<module path>.lora_B.weight": [out, r]} with
    paths relative to `model` (e.g. "model.layers.0.self_attn.q_proj.lora_A.weight").
    Tensors are the live parameters (detached), on their own device; scanned layers give each
    layer's weights under the same names, as host copies (ScannedLayers.lora_state_dict)."""
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            state[f"{name}.lora_A.weight"] = module.lora_A.weight.detach()
            state[f"{name}.lora_B.weight"] = module.lora_B.weight.detach()
        elif isinstance(module, ScannedLayers):
            state.update(module.lora_state_dict(name))
    return state
