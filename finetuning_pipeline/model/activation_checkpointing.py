"""Activation checkpointing: keep only each decoder layer's input in the forward and recompute
the layer in the backward (model.activation_checkpointing).

transformers' own switch wraps each layer's forward in a checkpoint function; here that function
is the device's (utils/device_ops.py): PyTorch's non-reentrant checkpoint eagerly and under
torch.compile, which restores the RNG for the recompute; on XLA torch_xla's, behind an
optimization barrier, with a quantized base's codes and scales among the inputs it separates
(runtime/xla/device_ops.py says why).

Two ways: `full` (or `true`) recomputes the whole layer; `selective` (the native runtime's)
keeps the attention kernel's outputs and recomputes the rest, by PyTorch's selective checkpoint
policy (torch.utils.checkpoint.create_selective_checkpoint_contexts), eagerly and under
torch.compile: full's memory plus one attention output a layer, without the attention's
recompute (its cost grows with the square of the sequence). torchtitan's op-level policy keeps the
matmuls' outputs too, which pays for a full fine-tune, whose backward needs every matmul's input
anyway; under a LoRA on a frozen base it kept more than no checkpointing at all (one compiled
2-layer model of hidden 1024, seq 512: 90.3 MiB saved for the backward against 76.5 unchecked,
10.0 full, 14.0 this policy; tests/lora_logic/test_compile.py reads the same at a smaller shape).
Under torch.compile (runtime.compile=layers) the checkpoint is traced with the layer
(traced_checkpoint): one compiled graph for every layer, its recompute compiled too.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lora_logic.layer import shared_inputs
from utils.device_ops import EAGER, ops_for
from utils.precision import keeping_float64

FULL, SELECTIVE = "full", "selective"


class ProvenSafeSelectiveCheckpoint(logging.Filter):
    """Drops dynamo's warning that a selective checkpoint (a context_fn) under torch.compile must
    hold no in-place op: ours, a decoder layer under SAVED_OPS' policy, is proven equal to the
    unchecked layer in float64, compiled (tests/finetuning_pipeline/runtime/test_compiled_layers.py),
    and a user can do nothing about the warning."""

    WARNING = "context_fn is passed to torch.utils.checkpoint under torch.compile"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.WARNING not in record.getMessage()


PROVEN_SAFE = ProvenSafeSelectiveCheckpoint()


def checkpointing_mode(setting: bool | str) -> str | None:
    """model.activation_checkpointing as a mode: None (off), FULL (true is its alias) or SELECTIVE."""
    if setting is False:
        return None
    return FULL if setting is True else setting


def enable_activation_checkpointing(model: torch.nn.Module, mode: str = FULL) -> int:
    """Checkpoint every decoder layer of a Hugging Face model with the device's checkpoint
    (checkpoint_layer) in `mode` (FULL or SELECTIVE); returns the number of layers checkpointed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    if mode == SELECTIVE:
        logging.getLogger("torch._higher_order_ops.wrap").addFilter(PROVEN_SAFE)  # (once: a filter is added once)
    layers = 0
    checkpoint = functools.partial(checkpoint_layer, selective=mode == SELECTIVE)
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):  # what transformers calls on a checkpointed layer
            module._gradient_checkpointing_func = checkpoint
            layers += isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing
    if layers == 0:
        raise ValueError(f"{type(model).__name__}: no layer accepted activation checkpointing")
    return layers


def checkpoint_layer(function, *args, selective: bool = False):
    """The device's checkpoint of `function(*args)`, where `function` is what transformers passes
    (`partial(forward, layer, **kwargs)`); a float64 step's precision is carried into the recompute.
    selective: the attention kernel's outputs kept (SAVED_OPS), the rest recomputed."""
    layer = function.args[0] if isinstance(function, functools.partial) and function.args else None
    hidden = next((arg for arg in args if torch.is_tensor(arg) and arg.is_floating_point()), None)
    if torch.compiler.is_dynamo_compiling():
        return traced_checkpoint(function, layer, hidden, args, selective)
    if hidden is not None and hidden.dtype == torch.float64:
        # The recompute runs in the backward, on the autograd engine's thread: the float64 of
        # the step around it (utils/precision.py) is carried into it here.
        function = keeping_float64(function)
    if selective:
        return selective_checkpoint(function, hidden, *args)
    return ops_for(hidden).checkpoint_layer(function, layer, *args)


def traced_checkpoint(function, layer, hidden, args: tuple, selective: bool):
    """The checkpoint inside a compiled decoder layer (runtime.compile=layers): dynamo traces it
    as one region of the layer's graph, whose recompute is the traced forward run again in the
    compiled backward, so the layers keep sharing one compiled graph and no Python runs twice (a
    float64 step's precision is in the trace already). Inside that region dynamo refuses any
    change to an object from outside it (a graph break that left every checkpointed layer
    eager), so the LoRA's siblings there compute their own A products rather than hand one over
    (lora_logic/layer.py's SharedInput, suspended around the region: the same sums)."""
    shared = shared_inputs(layer) if layer is not None else []
    for sharing in shared:
        sharing.suspended = True
    try:
        if selective:
            return selective_checkpoint(function, hidden, *args)
        return ops_for(hidden).checkpoint_layer(function, layer, *args)
    finally:
        for sharing in shared:
            sharing.suspended = False


def selective_checkpoint(function, hidden, *args):
    """function(*args) under PyTorch's selective checkpoint: SAVED_OPS' outputs kept for the
    backward, everything else recomputed. PyTorch's checkpoint only (the native runtime's: the
    XLA runtime refuses `selective` before the run)."""
    if ops_for(hidden) is not EAGER:
        raise ValueError("model.activation_checkpointing=selective runs on the native runtime only; the XLA runtime "
                         "recomputes whole layers (full)")
    context = functools.partial(create_selective_checkpoint_contexts, _keep_attention)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=context)


def _saved_ops() -> frozenset:
    """PyTorch's attention kernels (scaled_dot_product_attention's, on each device), whose outputs a
    selective checkpoint keeps. A model run with attn_implementation="eager" calls none: its
    selective checkpoint is full's."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


SAVED_OPS = _saved_ops()


def _keep_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE
