"""Fold every LoRA update of a model into its base weights, or take it out again."""

from __future__ import annotations

import torch
from torch import nn

from lora_logic.adapters import lora_modules
from lora_logic.modules_to_save import unload_modules_to_save


def merge_lora(model: nn.Module) -> int:
    """W0 <- W0 + scaling * B A in every LoRA layer (a model of one adapter: adapters side by side
    serve different rows, so none merges); returns how many layers changed.

    Idempotent (merged layers are skipped). Every adapter weight is checked for NaN/inf
    before the first base weight is touched, so a corrupt adapter leaves the model unmerged.
    """
    modules = list(lora_modules(model))
    if not modules:
        raise ValueError("merge_lora: the model has no LoRA layers (call inject_lora or load_adapters first)")
    with torch.no_grad():
        bad = [
            name
            for name, m in modules
            if not all(bool(torch.isfinite(p).all()) for p in [*m.lora_A.parameters(), *m.lora_B.parameters()])
        ]
    if bad:
        raise ValueError(
            f"refusing to merge: {len(bad)} LoRA layers hold NaN/inf (first: {bad[0]!r}); "
            "the adapter is corrupt, the base weights were left untouched"
        )
    return _set_merged(modules, True)


def unmerge_lora(model: nn.Module) -> int:
    """Undo `merge_lora`; returns how many layers changed. Idempotent."""
    return _set_merged(list(lora_modules(model)), False)


def _set_merged(modules: list, merged: bool) -> int:
    """Merge or unmerge each layer not already so; errors name the layer."""
    changed = 0
    for name, module in modules:
        if module.merged != merged:
            try:
                module.merge() if merged else module.unmerge()
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
            changed += 1
    return changed


def merge_and_unload(model: nn.Module) -> int:
    """Merge every LoRA update into its base layer, then put the plain `nn.Linear` back in
    the LoRA layer's place. Afterwards the model is an ordinary model again: its state dict
    has the original key names (what a merged export needs), and `inject_lora` can start a
    fresh adapter on it. Modules trained in full (modules_to_save) are replaced by their trained
    copies, in the base's dtype. Returns how many LoRA layers were unloaded."""
    merge_lora(model)
    modules = list(lora_modules(model))
    for name, module in modules:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, module.base_layer)
    unload_modules_to_save(model)
    return len(modules)
