"""`QuantizedLinear`: a frozen `nn.Linear` whose weight is stored block-quantized
(lora_logic/quantize.py) and dequantized just before its matmul, as QLoRA and qwix do.

The codes and scales are the module's buffers, so they move with the model, are stacked by the
layer scan and sharded by fsdp like any weight, and the weight in the compute dtype exists only
inside the step, where XLA fuses the dequantization into its consumer. torch_xla's own quantized
matmul cannot stand in: on the XLA device it has no autograd kernel, so the input's gradient is
None after backward and the LoRA beneath would get no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lora_logic.quantize import QuantizedWeight, dequantize, nf4_code_tensor, quantize


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
        if q.format == "nf4":  # the code values on the device, not a constant sent at every step
            self.register_buffer("nf4_code", nf4_code_tensor(q.codes.device), persistent=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> "QuantizedLinear":
        return cls(quantize(linear.weight, fmt), linear.bias, linear.weight.dtype)

    @property
    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.format, (self.out_features, self.in_features), self.codes, self.scales)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight in the compute dtype: code value x scale in fp32, cast once."""
        return dequantize(self.quantized, self.compute_dtype, getattr(self, "nf4_code", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.format}, compute_dtype={self.compute_dtype}")


def is_linear(module: nn.Module) -> bool:
    """A layer the LoRA can wrap: an `nn.Linear`, stored plain or quantized."""
    return isinstance(module, (nn.Linear, QuantizedLinear))
