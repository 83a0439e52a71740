"""`LoRALinear`: a frozen `nn.Linear` plus a trainable low-rank update."""

from __future__ import annotations

import math

import torch
from torch import nn

from lora_logic.config import lora_scaling
from lora_logic.dropout import SeededDropout


def init_lora_A_(weight: torch.Tensor) -> None:
    """Kaiming-uniform with a=sqrt(5): `nn.Linear`'s own default init, which PEFT and the LoRA
    paper's reference code use for A. Bound = 1/sqrt(in_features)."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def init_lora_B_(weight: torch.Tensor) -> None:
    """Zeros (LoRA paper, section 4.1): B A = 0, so the wrapped model equals the base at step 0."""
    nn.init.zeros_(weight)


class LoRALinear(nn.Module):
    """y = W0 x + b0 + scaling * B(A(dropout(x))), with W0, b0 frozen and A, B trainable.

    Wraps (does not subclass) `base_layer`, so any `nn.Linear` (bias or not, any dtype) works
    and the base stays reachable as `self.base_layer`, the name PEFT gives it too.

    Shapes: x [..., in] -> A: [r, in] -> [..., r] -> B: [out, r] -> [..., out]. The update is
    applied as two thin matmuls; the [out, in] product B A is only formed by `merge()`.

    Dtypes: the base weights may be bf16 while `lora_A`/`lora_B` hold fp32 master weights
    (AdamW's moments and small updates need fp32). The LoRA branch computes in the
    activation's dtype: the [r, in] and [out, r] weights are cast down (cheap) instead of
    casting the [batch, seq, in] activations up (costly), and the cast is differentiable, so
    gradients arrive in fp32 on the master weights. With fp32 activations everything is fp32.

    `merged` is True after `merge()`: W0 then holds W0 + scaling * B A and the forward skips
    the branch. `merge()`/`unmerge()` are idempotent and never write NaN/inf into W0.
    """

    def __init__(
        self,
        base_layer: nn.Linear,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        lora_dtype: torch.dtype = torch.float32,
        dropout_salt: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"LoRALinear wraps nn.Linear, got {type(base_layer).__name__}")
        if r <= 0:
            raise ValueError(f"r must be positive, got {r}")
        self.base_layer = base_layer
        self.r = r
        self.alpha = alpha
        self.use_rslora = use_rslora
        self.scaling = lora_scaling(alpha, r, use_rslora)
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        # Seeded (lora_logic/dropout.py): the mask follows the micro-batch's seed, so a step
        # traced once and replayed, or a recomputed layer, draws the same one.
        self.lora_dropout = SeededDropout(dropout, dropout_salt) if dropout > 0 else nn.Identity()
        device = base_layer.weight.device
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=lora_dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=lora_dtype)
        # The scaling as a tensor that moves with the module: on XLA a Python float in an
        # operation becomes a scalar looked up and wrapped at every trace (16 us per operation
        # against 5 for a tensor operand, measured), in the forward and again in the backward.
        self.register_buffer("scaling_tensor", torch.tensor(self.scaling, dtype=lora_dtype, device=device),
                             persistent=False)
        self.reset_lora_parameters()
        for p in self.base_layer.parameters():
            p.requires_grad_(False)
        self.merged = False

    def reset_lora_parameters(self) -> None:
        init_lora_A_(self.lora_A.weight)
        init_lora_B_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.merged:
            return y
        h = self.lora_dropout(x)
        a = self.lora_A.weight.to(h.dtype)  # [r, in]
        # Scale B ([out, r]), not the [batch, seq, out] product: the same update, one
        # activation-sized multiplication fewer in the forward and in the backward.
        b = (self.lora_B.weight * self.scaling_tensor).to(h.dtype)  # [out, r]
        # Two 2-D products on the activations flattened once: F.linear on [batch, seq, in]
        # flattens and restores around each product, operations that XLA traces on the host
        # at every step, forward and backward (14 wrapped 64-wide layers: 6.6 -> 5.2 ms of tracing).
        update = (h.reshape(-1, self.in_features) @ a.t()) @ b.t()  # [batch*seq, out]
        return y + update.view(y.shape)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B A in fp32, [out, in]: what `merge()` adds to W0."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into W0 (for export/inference). A no-op when already merged."""
        if self.merged:
            return
        self._write_base(self.base_layer.weight.float() + self.delta_weight(), "merge")
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the update from W0 again. Exact up to rounding in W0's dtype: with a bf16
        base, W0 comes back within one bf16 rounding step, not bitwise."""
        if not self.merged:
            return
        self._write_base(self.base_layer.weight.float() - self.delta_weight(), "unmerge")
        self.merged = False

    def _write_base(self, new_weight: torch.Tensor, action: str) -> None:
        new_weight = new_weight.to(self.base_layer.weight.dtype)
        # Refuse rather than corrupt the base: a NaN in W0 survives every later unmerge.
        if not bool(torch.isfinite(new_weight).all()):
            raise ValueError(
                f"refusing to {action} a LoRA update with NaN/inf values into the base weight "
                f"[{self.out_features}, {self.in_features}]; the adapter is corrupt (check the training loss)"
            )
        self.base_layer.weight.copy_(new_weight)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, r={self.r}, "
            f"scaling={self.scaling:g}, merged={self.merged}"
        )
