"""Activation checkpointing: keep only each decoder layer's input in the forward and recompute
the layer in the backward (model.activation_checkpointing).

transformers' own switch wraps each layer in a checkpoint function; here that function is the
device's (utils/device_ops.py): PyTorch's non-reentrant checkpoint eagerly and under
torch.compile, which restores the RNG for the recompute; on XLA torch_xla's, behind an
optimization barrier, with a quantized base's codes and scales among the inputs it separates
(runtime/xla/device_ops.py says why).
"""

from __future__ import annotations

import functools

import torch

from utils.device_ops import ops_for
from utils.precision import keeping_float64


def enable_activation_checkpointing(model: torch.nn.Module) -> int:
    """Checkpoint every decoder layer of a Hugging Face model with the device's checkpoint
    (checkpoint_layer); returns the number of layers checkpointed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    layers = 0
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):  # what transformers calls on a checkpointed layer
            module._gradient_checkpointing_func = checkpoint_layer
            layers += isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing
    if layers == 0:
        raise ValueError(f"{type(model).__name__}: no layer accepted activation checkpointing")
    return layers


def checkpoint_layer(function, *args):
    """The device's checkpoint of `function(*args)`, where `function` is what transformers passes
    (`partial(forward, layer, **kwargs)`); a float64 step's precision is carried into the recompute."""
    layer = function.args[0] if isinstance(function, functools.partial) and function.args else None
    hidden = next((arg for arg in args if torch.is_tensor(arg) and arg.is_floating_point()), None)
    if hidden is not None and hidden.dtype == torch.float64:
        # The recompute runs in the backward, on the autograd engine's thread: the float64 of
        # the step around it (utils/precision.py) is carried into it here.
        function = keeping_float64(function)
    return ops_for(hidden).checkpoint_layer(function, layer, *args)
