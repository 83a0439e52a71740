"""Find the target `nn.Linear` layers of a model by name suffix and wrap them in `LoRALinear`."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lora_logic.adapters import lora_modules
from lora_logic.config import LoraConfig, adapter_set, matches_target
from lora_logic.layer import LoRALinear, share_input
from lora_logic.modules_to_save import wrap_modules_to_save
from lora_logic.quantized_linear import is_linear
from lora_logic.trainable_tokens import wrap_trainable_tokens

# The projections that a Hugging Face decoder calls on one tensor: attention's q, k and v on the
# normed hidden states, the MLP's gate and up on its input. Wrapped siblings of one set share
# their A product (lora_logic/layer.py, share_input); a model that feeds them different tensors
# stays correct, each computing its own.
SHARED_INPUT_SETS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def inject_lora(model: nn.Module, adapters: LoraConfig | Mapping[str, LoraConfig]) -> list[str]:
    """Wrap every `nn.Linear` that an adapter targets (`target_modules`, by name suffix) in a
    LoRALinear and give it the adapters that target it; returns the wrapped module names.

    adapters: {name: config}, in the order of their rows in a batch when there are several (side
    by side, lora_logic/layer.py); a LoraConfig alone is the set of one adapter, DEFAULT_ADAPTER.
    Each adapter starts as it would alone: torch's generator is put back to its state on entry
    before each adapter's init, and a layer's dropout salt is its index among that adapter's targets.

    Freezes every parameter of `model`, then makes only the new `lora_A`/`lora_B` weights
    trainable, and the copies of an adapter's `modules_to_save` (lora_logic/modules_to_save.py:
    one adapter only, refused side by side). Raises `ValueError` when a target matches no
    `nn.Linear` (listing the Linear names that do exist) and when `model` already has LoRA.
    """
    adapters = adapter_set(adapters)
    saving = [name for name, c in adapters.items() if c.modules_to_save or c.trainable_token_indices is not None]
    if saving and len(adapters) > 1:
        raise ValueError(f"lora.modules_to_save or trainable_token_indices with adapters side by side "
                         f"({', '.join(adapters)}): each adapter would need its own copy of the embeddings; train "
                         "such adapters one at a time")
    existing = [name for name, _ in lora_modules(model)]
    if existing:
        raise ValueError(
            f"model already has {len(existing)} LoRA layers (e.g. {existing[0]!r}); "
            "inject_lora must be called once per model (load a fresh base, or merge and re-load)"
        )
    linear_names = [name for name, m in model.named_modules() if is_linear(m)]
    targets = {}
    for adapter, config in adapters.items():
        targets[adapter] = [n for n in linear_names if any(matches_target(n, t) for t in config.target_modules)]
        unmatched = [t for t in config.target_modules if not any(matches_target(n, t) for n in targets[adapter])]
        if unmatched:
            leaf_names = sorted({name.rsplit(".", 1)[-1] for name in linear_names})
            where = "lora.target_modules" if len(adapters) == 1 else f"adapter {adapter}: target_modules"
            raise ValueError(f"{where} {unmatched} match no nn.Linear in {type(model).__name__}. Linear layer names "
                             f"in this model: {leaf_names}. Fix {where}.")
    to_wrap = [n for n in linear_names if any(n in names for names in targets.values())]

    for param in model.parameters():
        param.requires_grad_(False)
    wrapped = {}
    for name in to_wrap:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child_name)
        wrapped[name] = LoRALinear(base, list(adapters))
        # New modules start in training mode; keep the model's mode (no live dropout in eval).
        wrapped[name].train(base.training)
        setattr(parent, child_name, wrapped[name])
    for siblings in sibling_sets(wrapped):
        share_input(siblings)
    rng = torch.get_rng_state()
    for adapter, config in adapters.items():
        torch.set_rng_state(rng)
        for salt, name in enumerate(targets[adapter]):  # each layer its own dropout masks
            wrapped[name].add_adapter(adapter, config, dropout_salt=salt)
    for adapter in saving:
        if adapters[adapter].modules_to_save:
            wrap_modules_to_save(model, adapters[adapter].modules_to_save, adapter)
        if adapters[adapter].trainable_token_indices is not None:
            wrap_trainable_tokens(model, adapters[adapter].trainable_token_indices, adapter)
    return to_wrap


def sibling_sets(wrapped: Mapping[str, LoRALinear]) -> list[list[LoRALinear]]:
    """The wrapped layers of each SHARED_INPUT_SETS set under one parent module, where two or more are wrapped."""
    sets = {}
    for name, layer in wrapped.items():
        parent, _, leaf = name.rpartition(".")
        for index, names in enumerate(SHARED_INPUT_SETS):
            if leaf in names:
                sets.setdefault((parent, index), []).append(layer)
    return [layers for layers in sets.values() if len(layers) > 1]
