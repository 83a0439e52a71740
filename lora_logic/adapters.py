"""A model's set of adapters: which there are, their weights by name, one adapter on every row.

The LoRA weights live in `LoRALinear` layers (lora_logic/layer.py), or, when a module stands for
several identical layers at once (the decoder layers run as one XLA loop,
finetuning_pipeline/runtime/xla/layer_scan.py), stacked in that module. Such a module is found by the
two things it offers, so this package needs nothing of it:
  stacked_lora_parameters()  [(the weight's name within one layer, its stack [layers, ...])]
  template                   one layer's modules (their settings; its LoRALinear layers hold no
                             weights of their own)
and len(module), the number of layers it stands for.

Names: a weight's name in the model is "<module path>.lora_A.<adapter>.weight" (PEFT's in-memory
name); an adapter's state dict names its weights "<module path>.lora_A.weight" as a model of
that adapter alone does, and as PEFT writes them. A module trained in full beside the LoRA
(lora_logic/modules_to_save.py) is part of its adapter too: "<module path>.modules_to_save.<adapter>.weight"
in the model, "<module path>.weight" in the state dict; a weight two such modules share (tied
embeddings) is one trainable weight, listed once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lora_logic.config import DEFAULT_ADAPTER
from lora_logic.layer import LoRALinear
from lora_logic.modules_to_save import COPIES, ModuleAdapter, saved_modules
from lora_logic.trainable_tokens import DELTAS


def stacks_lora(module: nn.Module) -> bool:
    """Whether `module` holds the LoRA weights of several layers stacked (see above)."""
    return hasattr(module, "stacked_lora_parameters")


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(name, module) for every LoRALinear in `model`, in `named_modules()` order.

    Stacked layers hold their LoRA weights in no LoRALinear: a model with them is refused here,
    so injecting, loading and merging (which go through this) say so instead of finding no LoRA."""
    for name, module in model.named_modules():
        if stacks_lora(module):
            raise ValueError(f"{name}: the decoder layers are scanned (runtime/xla/layer_scan.py), their LoRA "
                             "weights stacked; inject, load or merge adapters before scan_decoder_layers")
        if isinstance(module, LoRALinear):
            yield name, module


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    """Every LoRALinear of the model, stacked layers' template's too (it holds their settings)."""
    found = []
    for module in model.modules():
        if isinstance(module, LoRALinear):
            found.append(module)
        elif stacks_lora(module):
            found += [m for m in module.template.modules() if isinstance(m, LoRALinear)]
    return found


def adapter_names(model: nn.Module) -> list[str]:
    """The model's adapters, in the order of their rows in a batch ([] without LoRA)."""
    layers = lora_layers(model)
    return list(layers[0].groups) if layers else []


def adapter_of(parameter_name: str) -> str:
    """The adapter of a trainable weight, from its name ("...q_proj.lora_A.<adapter>.weight",
    "...embed_tokens.modules_to_save.<adapter>.weight")."""
    parts = parameter_name.split(".")
    where = max(i for i, part in enumerate(parts) if part in ("lora_A", "lora_B", COPIES, DELTAS))
    return parts[where + 1]


def is_whole_module_weight(parameter_name: str) -> bool:
    """Whether a trainable weight is a module trained whole (modules_to_save's copy): as large as
    the base's own matrix, so sharded as it is under fsdp."""
    return f".{COPIES}." in f".{parameter_name}"


def is_embedding_weight(parameter_name: str) -> bool:
    """Whether a trainable weight is an embedding's (modules_to_save, trainable token rows), not a
    LoRA matrix: what train.embedding_lr trains at."""
    return any(f".{part}." in f".{parameter_name}" for part in (COPIES, DELTAS))


def _owned_trainable(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """(module name, module, its trainable weights by their names in the model) per owner of
    trainable weights (LoRA layers, stacked layers, modules trained in full), in module order; a
    weight shared by two owners (tied embeddings) is the first one's."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, (LoRALinear, ModuleAdapter)):
            own = [(prefix + n, p) for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
        elif stacks_lora(module):
            own = [(prefix + n, p) for n, p in module.stacked_lora_parameters()]
        else:
            continue
        seen.update(id(p) for _, p in own)
        yield name, module, own


def named_lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' trainable weights, the only thing the optimizer sees, with their names, in
    module order: A then B of each adapter per layer (each adapter's A, then each one's B), and
    the weights of modules trained in full. Stacked layers give one [layers, ...] stack per weight
    of their template, named "<module path>.<weight's name within a layer>"."""
    return [named for _, _, own in _owned_trainable(model) for named in own]


def adapter_groups(model: nn.Module) -> list[int]:
    """Each trainable LoRA weight's adapter, as its index in the rows' order, in
    `named_lora_parameters`' order: the groups of one optimizer over adapters side by side."""
    names = adapter_names(model)
    return [names.index(adapter_of(n)) for n, _ in named_lora_parameters(model)]


def lora_parameters(model: nn.Module, adapter: str | None = None) -> list[nn.Parameter]:
    """The trainable LoRA weights in `named_lora_parameters`' order: every adapter's, or one's."""
    return [p for n, p in named_lora_parameters(model) if adapter is None or adapter_of(n) == adapter]


def lora_state_dict(model: nn.Module, adapter: str = DEFAULT_ADAPTER) -> dict[str, torch.Tensor]:
    """One adapter's weights, {"<module path>.lora_A.weight": [r, in], "<module path>.lora_B.weight":
    [out, r]}, named as in a model of it alone, paths relative to `model` (e.g.
    "model.layers.0.self_attn.q_proj.lora_A.weight"). Tensors are the live parameters (detached),
    on their own device; stacked layers give each layer's weights under the same names, as host
    copies (a device slice per tensor would be a graph to compile per tensor)."""
    state = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, ModuleAdapter):
            state.update({prefix + n: t for n, t in module.saved_weights(adapter).items()})
        elif isinstance(module, LoRALinear) and adapter in module.lora_A:
            state[f"{prefix}lora_A.weight"] = module.lora_A[adapter].weight.detach()
            state[f"{prefix}lora_B.weight"] = module.lora_B[adapter].weight.detach()
        elif stacks_lora(module):
            stacks = {n: p.detach().to("cpu") for n, p in module.stacked_lora_parameters() if adapter_of(n) == adapter}
            for layer in range(len(module)):
                state.update({f"{prefix}{layer}.{n.replace(f'.{adapter}.weight', '.weight')}": stack[layer]
                              for n, stack in stacks.items()})
    return state


@contextlib.contextmanager
def only_adapter(model: nn.Module, adapter: str):
    """Within: every row goes through `adapter` alone (evaluating or generating with one adapter
    of several), as a model of that adapter alone."""
    layers = lora_layers(model) + [m for _, m in saved_modules(model)]
    saved = [layer.groups for layer in layers]
    for layer in layers:
        layer.groups = [adapter]
    try:
        yield model
    finally:
        for layer, groups in zip(layers, saved):
            layer.groups = groups


# -- the optimizer's layout (stacks) and a checkpoint's (one tensor per weight of each layer)
def _lora_owners(model: nn.Module) -> Iterator[tuple[int, int | None]]:
    """(tensors in lora_parameters, layers stacked in each or None) per owner, in order."""
    for _, module, own in _owned_trainable(model):
        yield len(own), (len(module) if stacks_lora(module) else None)


def per_layer_lora_names(model: nn.Module) -> list[str]:
    """The name of each LoRA weight of the unstacked model, in `per_layer_lora`'s order:
    "<module path>.lora_A.<adapter>.weight", a stacked module's layers numbered as the model
    without it numbers them. What a checkpoint keys each weight's optimizer state by."""
    names = []
    for name, module, own in _owned_trainable(model):
        if stacks_lora(module):
            prefix = f"{name}." if name else ""
            inner = [n for n, _ in module.stacked_lora_parameters()]
            names += [f"{prefix}{layer}.{n}" for layer in range(len(module)) for n in inner]
        else:
            names += [n for n, _ in own]
    return names


def per_layer_lora(model: nn.Module, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors laid out as `lora_parameters(model)` (an optimizer's moments) -> one per LoRA
    weight of the unstacked model, in module order: each stack split into its layers. What a
    checkpoint stores, so it resumes with the layers scanned or not."""
    out, start = [], 0
    for width, layers in _lora_owners(model):
        group, start = tensors[start:start + width], start + width
        out += group if layers is None else [stack[layer] for layer in range(layers) for stack in group]
    if start != len(tensors):
        raise ValueError(f"{len(tensors)} tensors for the model's {start} LoRA parameters")
    return out


def stacked_lora(model: nn.Module, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of `per_layer_lora`: one tensor per LoRA weight of the unstacked model ->
    laid out as `lora_parameters(model)`, stacked layers' weights stacked."""
    out, start = [], 0
    for width, layers in _lora_owners(model):
        count = width * (layers or 1)
        group, start = tensors[start:start + count], start + count
        out += group if layers is None else [torch.stack(group[i::width]) for i in range(width)]
    if start != len(tensors):
        raise ValueError(f"{len(tensors)} tensors for the model's {start} LoRA weights")
    return out
