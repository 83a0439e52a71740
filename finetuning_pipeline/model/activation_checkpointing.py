"""Gradient (activation) checkpointing for XLA: keep only each decoder layer's input in the
forward and recompute the layer in the backward.

transformers' own switch wraps layers in `torch.utils.checkpoint`, which XLA undoes: the
recomputation is the same expression as the forward, so the compiler's common-subexpression
elimination merges the two and keeps the activations after all. `torch_xla.utils.checkpoint`
puts an optimization barrier around the recomputed inputs so the recompute really happens.
It is the reentrant kind, which needs an input that requires grad: transformers' enable
call already makes the embedding output require it.
"""

from __future__ import annotations

import functools

import torch


def enable_activation_checkpointing(model: torch.nn.Module) -> int:
    """Checkpoint every decoder layer of a Hugging Face model with torch_xla's checkpoint;
    returns the number of layers checkpointed."""
    from torch_xla.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    xla_checkpoint = functools.partial(checkpoint, use_reentrant=True)
    layers = 0
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):  # what transformers calls on a checkpointed layer
            module._gradient_checkpointing_func = xla_checkpoint
            layers += isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing
    if layers == 0:
        raise ValueError(f"{type(model).__name__}: no layer accepted activation checkpointing")
    return layers
