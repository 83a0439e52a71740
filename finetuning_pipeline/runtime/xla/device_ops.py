"""torch_xla's forms of the operations model code leaves to the device (utils/device_ops.py),
for the tensors on an XLA device. init_xla_device puts them in use.

- An optimization barrier where XLA's common-subexpression elimination would merge a
  recompute with the expression it repeats (and keep its result alive in between).
- torch_xla's scan (an XLA While loop) for a loop over chunks: a Python loop puts every chunk
  into one graph, and XLA:CPU then keeps all their results at once (measured: as much memory
  as the full logits).
- torch_xla's reentrant checkpoint, whose optimization barrier keeps the recompute from being
  merged away. It is the reentrant kind, which needs an input that requires grad: transformers'
  enable call already makes the embedding output require it. A quantized base's codes and
  scales must cross that barrier too: torch_xla passes a module's weights through it only when
  handed a bound method, and transformers hands it a partial, so each layer's recomputed
  dequantization would be the forward's own expression, merged with it, and every layer's
  dequantized weights would stay alive from the forward to the backward. They are handed to the
  checkpoint as inputs (copies: its barrier rewrites its inputs in place) and the layer reads
  them from there.
- A table lookup as a tree of selects: an XLA gather per value is slow on a TPU.
- GELU in float64 from its formula: torch_xla 2.9 lowers it with its constants (1/sqrt(2),
  2/sqrt(pi)) rounded to fp32, 7e-9 off in float64 (Gemma's MLP).
"""

from __future__ import annotations

import contextlib

import torch

from finetuning_pipeline.runtime.xla.scan import scan
from lora_logic.quantize import nf4_selected
from lora_logic.quantized_linear import packed_buffers
from utils.device_ops import DeviceOps


class XlaOps(DeviceOps):
    gelu_from_formula = True

    def handles(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "xla"

    def barrier_copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies passed through one XLA optimization barrier. The originals are untouched (the
        barrier rewrites the copies in place; a module's buffer rewritten would become an output
        of the step). Inside a trace (the layer scan's body: fake tensors, no lazy graph yet) a
        copy is all that can be recorded, which keeps the traced expression apart from the
        forward's."""
        copies = [t.clone() for t in tensors]
        if all(type(t) is torch.Tensor for t in tensors):  # lazy tensors, not a trace's subclasses
            import torch_xla.core.xla_model as xm

            xm.optimization_barrier_(copies)
        return copies

    def loop(self, body, carry, xs):
        return scan(body, carry, xs, is_fn_pure=True)

    def checkpoint(self, function, *args):
        from torch_xla.utils.checkpoint import checkpoint

        return checkpoint(function, *args, use_reentrant=True)

    def checkpoint_layer(self, function, layer, *args):
        packed = packed_buffers(layer) if isinstance(layer, torch.nn.Module) else []
        if not packed:
            return self.checkpoint(function, *args)
        names = [name for name, _ in packed]

        def run(*inputs):
            with _buffers_replaced(layer, dict(zip(names, inputs[len(args):]))):
                return function(*inputs[:len(args)])

        return self.checkpoint(run, *args, *(tensor.clone() for _, tensor in packed))

    def nibble_lookup(self, table: torch.Tensor, nibbles: torch.Tensor) -> torch.Tensor:
        return nf4_selected(nibbles, table)


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


XLA_OPS = XlaOps()
