"""`ModulesToSave`: a module of the base trained in full beside the LoRA (PEFT's `modules_to_save`).

Continued pretraining on a new language needs what a LoRA on the linear layers cannot change:
the input embeddings and the output layer (`lora.modules_to_save: [embed_tokens, lm_head]`).
Each such module keeps its frozen original and gains a trainable copy per adapter, PEFT's
in-memory layout (`ModulesToSaveWrapper`: `original_module`, `modules_to_save[<adapter>]`), so a
weight's name in the model is "<module path>.modules_to_save.<adapter>.weight", and in a saved
adapter "<module path>.weight", as PEFT writes it.

The copy is kept in at least fp32 (full precision, as the LoRA's own weights are, under a bf16
or quantized base); the forward is the original module's own (Gemma's embedding scale, a
Linear's bias), run with the copy's weights cast to the original's dtype: the same computation
as the base's with other weights. The original stays for what needs the base: a preference
phase's reference routed past the adapter (only_adapter), and unloading.

Tied embeddings (Gemma, Qwen2-0.5B, Llama 3.2 1B: `lm_head.weight is embed_tokens.weight`): one
trainable tensor, the input embedding's copy, shared by the output layer's, as PEFT ties them with
`ensure_weight_tying` (which a saved adapter's config sets): trained once, a gradient from both
uses. A tied model's embedding or output layer listed alone is the pair: training one and not the
other would untie them.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call

from lora_logic.config import matches_target
from utils.precision import at_least_fp32

# PEFT's attribute names (peft/utils/other.py, ModulesToSaveWrapper).
COPIES = "modules_to_save"


class ModuleAdapter(nn.Module):
    """A base module whose weights an adapter replaces, in full (ModulesToSave) or by rows
    (lora_logic/trainable_tokens.py's TrainableTokens): it keeps the frozen `original_module`,
    and rows go through the weights of the adapter `groups` names (one adapter: side by side is
    refused at injection), or the original's when that adapter has none (BASE_REFERENCE routing,
    lora_logic/adapters.py only_adapter). The forward is the original module's own (Gemma's
    embedding scale, a Linear's bias) with the adapter's weights, in the original's dtype."""

    def __init__(self, original: nn.Module, adapters: list[str]) -> None:
        super().__init__()
        self.original_module = original
        self.groups = list(adapters)
        self._tied_to: list[ModuleAdapter] = []  # (a list: not a submodule of this one)

    @property
    def tied_to(self) -> ModuleAdapter | None:
        """The wrapper whose trained weights this one shares (a tied output layer: its input
        embedding's), or None."""
        return self._tied_to[0] if self._tied_to else None

    def adapter_weights(self, name: str) -> dict[str, torch.Tensor] | None:
        """{parameter name in the original: its value} under adapter `name`, or None (no weights of it)."""
        raise NotImplementedError

    def weights_now(self) -> dict[str, torch.Tensor] | None:
        (name,) = self.groups
        return self.adapter_weights(name)

    @property
    def weight(self) -> torch.Tensor:
        """The weight the forward uses (as PEFT's wrappers offer it): code that reads `lm_head.weight`."""
        weights = self.weights_now()
        return weights["weight"] if weights and "weight" in weights else self.original_module.weight

    def forward(self, *args, **kwargs):
        weights = self.weights_now()
        if weights is None:
            return self.original_module(*args, **kwargs)
        return functional_call(self.original_module, weights, args, kwargs, tie_weights=False)

    def unloaded(self) -> nn.Module:
        """The module to put back in the model: the original holding the adapter's weights (a
        merged model's), frozen, or the original itself when the adapter has none."""
        weights = self.weights_now()
        if weights is None:
            return self.original_module
        plain = copy.deepcopy(self.original_module)
        with torch.no_grad():
            for name, value in weights.items():
                plain.get_parameter(name).copy_(value)
        plain.requires_grad_(False)
        return plain


class ModulesToSave(ModuleAdapter):
    """A base module and its trainable copies, one per adapter (PEFT's ModulesToSaveWrapper)."""

    def __init__(self, original: nn.Module, adapters: list[str]) -> None:
        super().__init__(original, adapters)
        self.modules_to_save = nn.ModuleDict()

    def add_adapter(self, name: str, tied_to: ModulesToSave | None = None) -> None:
        """A trainable copy of the original for adapter `name`, in at least fp32; tied_to: the
        wrapper whose copy's weight this one shares (a tied output layer: the input embedding's)."""
        trained = copy.deepcopy(self.original_module)
        for parameter in trained.parameters():
            parameter.data = at_least_fp32(parameter.data).clone()
        if tied_to is not None:
            trained.weight = tied_to.modules_to_save[name].weight
            self._tied_to = [tied_to]
        trained.requires_grad_(True)
        self.modules_to_save[name] = trained

    def add_frozen_copy(self, source: str, name: str) -> None:
        """Adapter `name`: a frozen copy of adapter `source`'s module (LoRALinear.add_frozen_copy's
        counterpart: a preference phase's reference)."""
        if name in self.modules_to_save:
            raise ValueError(f"adapter {name!r}: already here")
        frozen = copy.deepcopy(self.modules_to_save[source])
        frozen.requires_grad_(False)
        self.modules_to_save[name] = frozen

    def adapter_weights(self, name: str) -> dict[str, torch.Tensor] | None:
        if name not in self.modules_to_save:
            return None
        dtypes = {n: p.dtype for n, p in self.original_module.named_parameters()}
        return {n: p.to(dtypes.get(n, p.dtype)) for n, p in self.modules_to_save[name].named_parameters()}

    def saved_weights(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter `name`'s tensors as a saved adapter names them, relative to this module."""
        if name not in self.modules_to_save:
            return {}
        return {n: p.detach() for n, p in self.modules_to_save[name].named_parameters()}


def saved_modules(model: nn.Module) -> list[tuple[str, ModuleAdapter]]:
    """(name, wrapper) of every ModuleAdapter (ModulesToSave, TrainableTokens) in `model`, in
    named_modules() order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ModuleAdapter)]


def tied_output_layer(model: nn.Module) -> tuple[str, str] | None:
    """(input embedding's name, output layer's name) when they share one weight, else None."""
    getters = [getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)]
    if not all(getters):
        return None
    embedding, head = (getter() for getter in getters)
    if embedding is None or head is None or getattr(embedding, "weight", None) is not getattr(head, "weight", 0):
        return None
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    return names[id(embedding)], names[id(head)]


def wrap_modules_to_save(model: nn.Module, module_names: list[str], adapter: str) -> list[str]:
    """Wrap the modules named in `module_names` (each matched by suffix, PEFT's rule) in
    ModulesToSave with a trainable copy for `adapter`; returns the wrapped names. A tied
    embedding and output layer are wrapped together, sharing one trainable weight (see above).
    A name that matches nothing, or a module that holds no parameters, is a ValueError."""
    named = dict(model.named_modules())
    chosen = []
    for wanted in module_names:
        found = [n for n in named if n and matches_target(n, wanted)]
        if not found:
            raise ValueError(f"lora.modules_to_save: {wanted!r} matches no module of {type(model).__name__}; name a "
                             "module as target_modules does (e.g. embed_tokens, lm_head)")
        chosen += [n for n in found if n not in chosen]
    tied = tied_output_layer(model)
    if tied and (tied[0] in chosen) != (tied[1] in chosen):
        chosen += [n for n in tied if n not in chosen]
    for name in chosen:
        if not any(True for _ in named[name].parameters()):
            raise ValueError(f"lora.modules_to_save: {name} holds no weights to train")
    wrapped: dict[str, ModulesToSave] = {}
    order = sorted(chosen, key=lambda n: (tied is not None and n == tied[1], list(named).index(n)))
    for name in order:  # a tied output layer after its embedding: it shares the embedding's copy
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapper = ModulesToSave(getattr(parent, child), [adapter])
        wrapper.train(wrapper.original_module.training)
        wrapper.add_adapter(adapter, tied_to=wrapped[tied[0]] if tied and name == tied[1] else None)
        setattr(parent, child, wrapper)
        wrapped[name] = wrapper
    return [n for n in named if n in wrapped]


def unload_modules_to_save(model: nn.Module) -> int:
    """Put each wrapper's module with the adapter's weights (ModuleAdapter.unloaded) in its
    place; tied ones stay tied. Returns how many were unloaded."""
    wrappers = saved_modules(model)
    plain: dict[int, nn.Module] = {}
    for name, wrapper in wrappers:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = wrapper.unloaded()
        if wrapper.tied_to is not None and id(wrapper.tied_to) in plain:
            module.weight = plain[id(wrapper.tied_to)].weight
        plain[id(wrapper)] = module
        setattr(parent, child, module)
    return len(wrappers)


def ties_embeddings(model: nn.Module) -> bool:
    """Whether an adapter's weights of the input embedding are shared by the output layer."""
    return any(wrapper.tied_to is not None for _, wrapper in saved_modules(model))
