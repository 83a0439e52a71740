"""The few operations whose best form depends on the compiler that runs them, chosen by the
tensor they act on, so that model code (the LoRA, the quantized base, the chunked loss,
activation checkpointing, the float64 proofs) names no runtime.

The forms here are eager PyTorch's, which torch.compile traces as they are. A runtime whose
compiler wants others adds its own for the tensors of its device when it starts (`use_ops`):
torch_xla's lazy graphs merge a recompute with the forward it repeats unless a barrier keeps
them apart, unroll a Python loop into one graph, and lower a small table lookup to a slow
gather (runtime/xla/device_ops.py). This is PyTorch's own dispatch by device, for six
operations, not a plug-in system: there is one such runtime.
"""

from __future__ import annotations

from typing import Callable

import torch


class DeviceOps:
    """Eager PyTorch's forms, for any tensor."""

    gelu_from_formula = False  # float64 GELU computed from its definition (precision.py), not by the op

    def handles(self, tensor: torch.Tensor) -> bool:
        return True

    def barrier_copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors as they are: eager kernels compute each expression where it is written."""
        return list(tensors)

    def loop(self, body: Callable, carry, xs: tuple[torch.Tensor, ...]):
        """(carry, stacked outputs) of body applied to each slice of xs' leading dimension in order."""
        outputs = []
        for index in range(xs[0].shape[0]):
            carry, out = body(carry, tuple(x[index] for x in xs))
            outputs.append(out)
        return carry, (torch.stack(outputs) if outputs[0] is not None else None)

    def checkpoint(self, function: Callable, *args):
        """function(*args), its activations recomputed in the backward: PyTorch's non-reentrant
        checkpoint, which restores the RNG for the recompute and which torch.compile traces."""
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    def checkpoint_layer(self, function: Callable, layer: torch.nn.Module | None, *args):
        """A decoder layer's forward (what transformers hands its checkpoint function), checkpointed."""
        return self.checkpoint(function, *args)

    def nibble_lookup(self, table: torch.Tensor, nibbles: torch.Tensor) -> torch.Tensor:
        """table[nibbles]: a 16-entry table indexed by 4-bit codes (nf4's)."""
        # int32 indices: int64 ones would be a weight-sized 8-byte tensor (emulated on a TPU).
        return table[nibbles.int()]


EAGER = DeviceOps()
_RUNTIME_OPS: list[DeviceOps] = []


def use_ops(ops: DeviceOps) -> None:
    """Take `ops` for the tensors it handles, from now on in this process (idempotent)."""
    if all(type(known) is not type(ops) for known in _RUNTIME_OPS):
        _RUNTIME_OPS.append(ops)


def ops_for(tensor: torch.Tensor | None) -> DeviceOps:
    """The forms for `tensor`'s device (eager PyTorch's unless a runtime added its own)."""
    if tensor is None:
        return EAGER
    return next((ops for ops in _RUNTIME_OPS if ops.handles(tensor)), EAGER)


def barrier_copies(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors, kept apart from the same expressions elsewhere in a compiled graph where the
    device's compiler would merge them (what is computed from the copies is computed again where
    they are used); the originals are untouched. Eagerly, the tensors themselves."""
    return ops_for(tensors[0]).barrier_copies(list(tensors)) if tensors else []
