"""Gradient (activation) checkpointing for XLA: keep only each decoder layer's input in the
forward and recompute the layer in the backward.

transformers' own switch wraps layers in `torch.utils.checkpoint`, which XLA undoes: the
recomputation is the same expression as the forward, so the compiler's common-subexpression
elimination merges the two and keeps the activations after all. `torch_xla.utils.checkpoint`
puts an optimization barrier around the recomputed inputs so the recompute really happens.
It is the reentrant kind, which needs an input that requires grad: transformers' enable
call already makes the embedding output require it.

A quantized base's codes and scales must cross that barrier too. torch_xla passes a module's
weights through it only when handed a bound method, and transformers hands it a partial, so
each layer's recomputed dequantization would be the forward's own expression, merged with it,
and every layer's dequantized weights would stay alive from the forward to the backward. So
they are handed to the checkpoint as inputs (copies: its barrier rewrites its inputs in place)
and the layer reads them from there.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from lora_logic.quantized_linear import packed_buffers
from utils.precision import keeping_float64


def enable_activation_checkpointing(model: torch.nn.Module) -> int:
    """Checkpoint every decoder layer of a Hugging Face model with torch_xla's checkpoint;
    returns the number of layers checkpointed."""
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
    """torch_xla's reentrant checkpoint of `function(*args)`, where `function` is what transformers
    passes (`partial(forward, layer, **kwargs)`), with the layer's quantized weights among the
    inputs its barrier separates. A layer off XLA (the native runtime) takes PyTorch's own
    non-reentrant checkpoint, which restores the RNG for the recompute (the model's dropout draws
    its forward's masks again) and is traced by torch.compile."""
    layer = function.args[0] if isinstance(function, functools.partial) and function.args else None
    packed = packed_buffers(layer) if isinstance(layer, torch.nn.Module) else []
    hidden = next((arg for arg in args if torch.is_tensor(arg) and arg.is_floating_point()), None)
    if hidden is not None and hidden.dtype == torch.float64:
        # The recompute runs in the backward, on the autograd engine's thread: the float64 of
        # the step around it (utils/precision.py) is carried into it here.
        function = keeping_float64(function)
    if hidden is None or hidden.device.type != "xla":
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    from torch_xla.utils.checkpoint import checkpoint

    if not packed:
        return checkpoint(function, *args, use_reentrant=True)
    names = [name for name, _ in packed]

    def run(*inputs):
        with _buffers_replaced(layer, dict(zip(names, inputs[len(args):]))):
            return function(*inputs[:len(args)])

    return checkpoint(run, *args, *(tensor.clone() for _, tensor in packed), use_reentrant=True)


@contextlib.contextmanager
def _buffers_replaced(module: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """`module`'s buffers of these names hold these tensors inside the block, their own after."""
    owners = []
    for name, tensor in tensors.items():
        path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(path)
        owners.append((owner, leaf, owner._buffers[leaf]))
        owner._buffers[leaf] = tensor
    try:
        yield
    finally:
        for owner, leaf, original in owners:
            owner._buffers[leaf] = original
