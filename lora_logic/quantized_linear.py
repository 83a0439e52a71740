"""`QuantizedLinear`: a frozen `nn.Linear` whose weight is stored block-quantized
(lora_logic/quantize.py) and dequantized just before its matmul, as QLoRA and qwix do.

The codes and scales are the module's buffers, so they move with the model, are stacked by the
layer scan and sharded by fsdp like any weight (FSDP2, which shards parameters, holds them as
parameters: hold_codes_as), and the weight in the compute dtype exists only
inside the step, where XLA fuses the dequantization into its consumer. The matmul's backward
dequantizes again rather than keep the forward's dequantized weight (what `F.linear`'s autograd
would save, layer after layer, until the backward: the memory quantization saves, given back),
as bitsandbytes' 4-bit matmul does; under torch.compile the forward's dequantization is marked
for recompute instead (recomputed_for_backward), which torch.compile's partitioner keeps to.
torch_xla's own quantized matmul cannot stand in: on the XLA device it has no autograd kernel,
so the input's gradient is None after backward and the LoRA beneath would get no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lora_logic.quantize import QuantizedWeight, dequantize, nf4_code_tensor, quantize
from utils.device_ops import barrier_copies


class QuantizedLinear(nn.Module):
    """y = dequantize(codes, scales) x + b, frozen. Made from an `nn.Linear` by `from_linear`;
    `compute_dtype` is the dtype the Linear's weight had (the model's dtype), which the
    dequantized weight takes."""

    def __init__(self, q: QuantizedWeight, bias: torch.Tensor | None, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.format = q.format
        self.out_features, self.in_features = q.shape
        self.compute_dtype = compute_dtype
        self.register_buffer("codes", q.codes)
        self.register_buffer("scales", q.scales)
        self.codes_dtype = q.codes.dtype  # (codes held as another dtype's bits read back as this: hold_codes_as)
        if q.format == "nf4":  # the code values on the device, not a constant sent at every step
            self.register_buffer("nf4_code", nf4_code_tensor(q.codes.device), persistent=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None
        # What makes the codes and scales whole before they are dequantized, where a sharder needs it:
        # the XLA runtime's fsdp (distributed/parallel.py) marks them replicated there, so its
        # partitioner gathers the codes (a byte or half a byte a weight), not the dequantized weight.
        self.gather_codes = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, compute_dtype: torch.dtype | None = None) -> "QuantizedLinear":
        """compute_dtype: the model's dtype when the Linear holds another (read as stored in its
        file): its values are cast to it before they are quantized, and its bias is cast to it."""
        dtype = compute_dtype or linear.weight.dtype
        bias = linear.bias.to(dtype) if linear.bias is not None else None
        return cls(quantize(linear.weight, fmt, dtype), bias, dtype)

    def hold_codes_as(self, dtype: torch.dtype) -> bool:
        """Hold codes and scales as frozen parameters, the codes' bits as `dtype`'s: what a sharder
        that holds floating-point parameters only (FSDP2) can shard and gather, bit for bit. False
        (nothing changed) when the codes' last dimension does not fill whole elements of `dtype`."""
        codes, scales = self.codes, self.scales
        if codes.shape[-1] * codes.element_size() % torch.empty((), dtype=dtype).element_size():
            return False
        del self.codes, self.scales  # (the buffers)
        self.codes = nn.Parameter(codes.view(dtype), requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        return True

    def _codes(self) -> torch.Tensor:
        return self.codes if self.codes.dtype == self.codes_dtype else self.codes.view(self.codes_dtype)

    @property
    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.format, (self.out_features, self.in_features), self._codes(), self.scales)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight in the compute dtype: code value x scale in fp32, cast once."""
        return dequantize(self.quantized, self.compute_dtype, getattr(self, "nf4_code", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = (self.format, (self.out_features, self.in_features), self.compute_dtype, self.gather_codes)
        if torch.compiler.is_dynamo_compiling():  # (the native runtime's compiled layers)
            weight = recomputed_for_backward(_dequantized, self._codes(), self.scales, getattr(self, "nf4_code", None),
                                             layout)
            return F.linear(x, weight, self.bias)
        return _QuantizedMatmul.apply(x, self._codes(), self.scales, getattr(self, "nf4_code", None), self.bias, layout)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.format}, compute_dtype={self.compute_dtype}")


class _QuantizedMatmul(torch.autograd.Function):
    """F.linear(x, dequantized weight, bias) for a frozen weight and bias, saving for the
    backward only the codes and scales (which the model holds anyway). The backward
    dequantizes them again behind an optimization barrier that takes the incoming gradient
    too: XLA can then neither merge it with the forward's dequantization (keeping that weight
    alive in between) nor compute it before the gradient arrives. The values are the same
    expression's, so the gradient is bitwise F.linear's."""

    @staticmethod
    def forward(ctx, x, codes, scales, nf4_code, bias, layout):
        fmt, shape, dtype, gather = layout
        ctx.layout = layout
        ctx.save_for_backward(codes, scales, nf4_code)
        # The forward's dequantization behind a barrier with its input too: it reads only codes and
        # scales, the same for every micro-batch, and XLA's loop-invariant code motion moved it out
        # of the micro-batch loop (micro_batch_loop.py), keeping every layer's dequantized weight for
        # the whole step. Tied to x it is computed where x is, micro-batch by micro-batch.
        # Not inside the layer scan's trace, where no barrier can be recorded (only copies, which its
        # partitioner would keep for the backward instead of recomputing them), and whose loop over
        # the layers already holds one layer's weight at a time.
        if type(x) is torch.Tensor:
            x, codes, scales = barrier_copies(x, codes, scales)
            codes, scales = _whole(gather, codes, scales)
        return F.linear(x, dequantize(QuantizedWeight(fmt, shape, codes, scales), dtype, nf4_code), bias)

    @staticmethod
    def backward(ctx, grad_output):
        codes, scales, nf4_code = ctx.saved_tensors
        grad_output, codes, scales = barrier_copies(grad_output, codes, scales)
        return grad_output.matmul(_dequantized(codes, scales, nf4_code, ctx.layout)), None, None, None, None, None


def recomputed_for_backward(function, *args):
    """function(*args) in a region torch.compile traces, marked for its partitioner to recompute in
    the backward rather than save (torch.utils.checkpoint's tags: MUST_RECOMPUTE for min-cut, which
    inductor uses, and which the default partitioner switches to once a graph carries them).
    _QuantizedMatmul's own backward does not survive there: AOTAutograd traces both its
    dequantizations, merges them as one expression (CSE), and its min-cut partitioner then saves
    the dequantized weight of every layer for the backward (it does not recompute what feeds a
    matmul), as much memory as the unquantized weights, given back (tested: what a compiled layer
    saves, by saved_tensors_hooks)."""
    return checkpoint(function, *args, use_reentrant=False)


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, nf4_code: torch.Tensor | None, layout) -> torch.Tensor:
    fmt, shape, dtype, gather = layout
    codes, scales = _whole(gather, codes, scales)
    return dequantize(QuantizedWeight(fmt, shape, codes, scales), dtype, nf4_code)


def _whole(gather, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales made whole by `gather` (QuantizedLinear.gather_codes), or as they are."""
    return (codes, scales) if gather is None else (gather(codes), gather(scales))


def is_linear(module: nn.Module) -> bool:
    """A layer the LoRA can wrap: an `nn.Linear`, stored plain or quantized."""
    return isinstance(module, (nn.Linear, QuantizedLinear))


def packed_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name in `module`, tensor) of the codes and scales of every QuantizedLinear inside
    `module`, in module order."""
    return [(f"{prefix}.{leaf}" if prefix else leaf, getattr(m, leaf))
            for prefix, m in module.named_modules() if isinstance(m, QuantizedLinear)
            for leaf in ("codes", "scales")]
