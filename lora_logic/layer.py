"""`LoRALinear`: a frozen `nn.Linear` plus trainable low-rank updates, one per adapter.

The adapters are keyed by name, PEFT's own in-memory layout (`lora_A[name]`, `lora_B[name]`,
`lora_dropout[name]`, `scaling[name]`). A model with one adapter is a set of one: its only
name is DEFAULT_ADAPTER and every row of a batch goes through it. Adapters trained side by
side split a batch's rows into equal groups, one per adapter, in the order `groups` gives
(the same in every layer of the model); each row goes through the frozen base once and
through its own group's adapter:

    y = W0 x + b0                                                   (all rows at once)
    y[k*b:(k+1)*b] += scaling_k * B_k A_k dropout_k(x[k*b:(k+1)*b])  (group k: adapter k)

so the base's weights are read once for every adapter (what makes a small-batch step, bound
by reading those weights, cheaper than K steps of K models), and each adapter's gradients
are those of its own rows' loss only. A layer that some adapter of the model does not target
leaves that adapter's rows to the base.

Layers that read one input (attention's q, k and v; the MLP's gate and up: `share_input`)
compute their A products as one: x [rows, in] @ [A_q; A_k; A_v]^T [in, r_q + r_k + r_v], split
by rank. Each output is the same sum as its own product, the activations are read once instead
of once per layer, forward and backward (the backward's dA and dx are then one product each
too), and the thin rank-r matmuls become one wider one. The siblings hold one `SharedInput`,
an explicit structure and no state on the tensors (which torch.compile cannot trace): the first
sibling called computes the product and leaves the others' parts there, for that very input
tensor, until each has taken its own; a sibling called with another tensor, or with its dropout
active (each layer draws its own mask), computes its own product as before.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lora_logic.config import DEFAULT_ADAPTER, LoraConfig, lora_scaling
from lora_logic.dropout import SeededDropout
from lora_logic.quantized_linear import QuantizedLinear, is_linear
from utils.device_ops import barrier_copies
from utils.precision import at_least_fp32


def init_lora_A_(weight: torch.Tensor) -> None:
    """Kaiming-uniform with a=sqrt(5): `nn.Linear`'s own default init, which PEFT and the LoRA
    paper's reference code use for A. Bound = 1/sqrt(in_features)."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def init_lora_B_(weight: torch.Tensor) -> None:
    """Zeros (LoRA paper, section 4.1): B A = 0, so the wrapped model equals the base at step 0."""
    nn.init.zeros_(weight)


def scaling_buffer(adapter: str) -> str:
    """The name of an adapter's scaling tensor among the layer's buffers."""
    return f"lora_scaling_{adapter}"


class LoRALinear(nn.Module):
    """y = W0 x + b0 + scaling * B(A(dropout(x))) per adapter, with W0, b0 frozen and each
    adapter's A, B trainable.

    Wraps (does not subclass) `base_layer`, so any `nn.Linear` (bias or not, any dtype) works,
    and a `QuantizedLinear` too (a quantized base beneath the LoRA, QLoRA), and the base stays
    reachable as `self.base_layer`, the name PEFT gives it too.
    groups: the model's adapters in the order of their rows in a batch (one adapter: every row).

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

    def __init__(self, base_layer: nn.Linear | QuantizedLinear,
                 groups: list[str] | tuple[str, ...] = (DEFAULT_ADAPTER,)) -> None:
        super().__init__()
        if not is_linear(base_layer):
            raise TypeError(f"LoRALinear wraps nn.Linear or QuantizedLinear, got {type(base_layer).__name__}")
        if not groups:
            raise ValueError("LoRALinear needs the model's adapters (groups), at least one")
        self.base_layer = base_layer
        self.groups = list(groups)
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.r: dict[str, int] = {}
        self.scaling: dict[str, float] = {}
        for p in self.base_layer.parameters():
            p.requires_grad_(False)
        self.merged = False
        # The LoRALinears that read the same input as this one, itself included (share_input), and
        # this one's place among them. Not registered (they are modules of their own elsewhere in
        # the model), and private: a layer's settings are compared by value (layer_scan.py).
        self._shared_input = SharedInput([self])
        self._sibling_index = 0

    @property
    def adapters(self) -> list[str]:
        """The adapters this layer trains (those of `groups` that target it), in the order added; not
        a frozen copy it holds beside them (add_frozen_copy)."""
        return [name for name in self.lora_A if name in self.groups]

    def add_adapter(self, name: str, config: LoraConfig, dropout_salt: int = 0,
                    lora_dtype: torch.dtype | None = None) -> None:
        """A new adapter: A Kaiming-uniform from torch's generator, B zeros (seed the generator
        first for a reproducible init). dropout_salt tells this layer's dropout masks from the
        other layers' (lora_logic/dropout.py). lora_dtype: fp32 under a bf16, fp16 or fp32 base,
        float64 under a float64 one (the CPU's exactness proofs); None: that rule."""
        if name in self.lora_A or name not in self.groups:
            raise ValueError(f"adapter {name!r}: already here, or not one of the model's adapters {self.groups}")
        if self.merged:
            raise ValueError(f"adapter {name!r}: the layer's adapters are merged; unmerge first")
        base = self.base_layer
        quantized = isinstance(base, QuantizedLinear)
        device = base.codes.device if quantized else base.weight.device
        lora_dtype = lora_dtype or torch.promote_types(base.compute_dtype if quantized else base.weight.dtype,
                                                       torch.float32)
        self.lora_A[name] = nn.Linear(self.in_features, config.r, bias=False, device=device, dtype=lora_dtype)
        self.lora_B[name] = nn.Linear(config.r, self.out_features, bias=False, device=device, dtype=lora_dtype)
        init_lora_A_(self.lora_A[name].weight)
        init_lora_B_(self.lora_B[name].weight)
        # Seeded (lora_logic/dropout.py): the mask follows the micro-batch's seed, so a step
        # traced once and replayed, or a recomputed layer, draws the same one.
        self.lora_dropout[name] = SeededDropout(config.dropout, dropout_salt) if config.dropout > 0 else nn.Identity()
        for module in (self.lora_A[name], self.lora_B[name], self.lora_dropout[name]):
            module.train(self.training)  # the layer's mode: no live dropout in eval
        self.r[name] = config.r
        self.scaling[name] = lora_scaling(config.alpha, config.r, config.use_rslora)
        # The scaling as a tensor that moves with the module: on XLA a Python float in an
        # operation becomes a scalar looked up and wrapped at every trace (16 us per operation
        # against 5 for a tensor operand, measured), in the forward and again in the backward.
        self.register_buffer(scaling_buffer(name), torch.tensor(self.scaling[name], dtype=lora_dtype, device=device),
                             persistent=False)

    @torch.no_grad()
    def add_frozen_copy(self, source: str, name: str) -> None:
        """Adapter `name`: a frozen copy of adapter `source` (its weights, rank and scaling; no
        dropout), outside the model's groups, so no row goes through it and no optimizer sees
        it until `only_adapter(model, name)` routes the rows there: a preference phase's
        reference, the adapter as the phase started (finetuning_pipeline/model/preference_loss.py)."""
        if name in self.lora_A or name in self.groups:
            raise ValueError(f"adapter {name!r}: already here, or one of the model's adapters {self.groups}")
        for matrices in (self.lora_A, self.lora_B):
            weight = matrices[source].weight
            copy = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
            copy.weight.copy_(weight)
            copy.weight.requires_grad_(False)
            matrices[name] = copy
        self.lora_dropout[name] = nn.Identity()
        self.r[name], self.scaling[name] = self.r[source], self.scaling[source]
        self.register_buffer(scaling_buffer(name), getattr(self, scaling_buffer(source)).clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)  # every group's rows at once: the base's weights read once
        if self.merged:
            return y
        if len(self.groups) == 1:  # one adapter on every row: no slicing
            name = self.groups[0]
            return y + self._update(name, x, None).view(y.shape) if name in self.lora_A else y
        rows = x.shape[0] // len(self.groups)
        if rows * len(self.groups) != x.shape[0]:
            raise ValueError(f"{x.shape[0]} rows do not split into {len(self.groups)} equal groups, one per adapter "
                             f"({', '.join(self.groups)})")
        out = []
        for k, name in enumerate(self.groups):
            y_k = y[k * rows:(k + 1) * rows]
            if name in self.lora_A:
                y_k = y_k + self._update(name, x, (k, len(self.groups))).view(y_k.shape)
            out.append(y_k)
        return torch.cat(out)

    def _update(self, name: str, x: torch.Tensor, group: tuple[int, int] | None) -> torch.Tensor:
        """scaling * B A dropout(x) of one adapter on its rows of x (group (k, count): the k-th of
        count equal row groups; None: all), [rows*seq, out]."""
        h = self._down(name, x, group)  # [rows*seq, r]
        # Scale the thin [rows*seq, r] product, not the [rows*seq, out] one (an activation-sized
        # multiplication fewer, forward and backward) nor B: with B scaled, the shared product's
        # slices are kernels of their own in every layer; scaled, each slice joins its
        # multiplication in a fusion that XLA compiles once for all layers (docs/benchmarks.md).
        h = (h * getattr(self, scaling_buffer(name))).to(h.dtype)
        return _ThinProduct.apply(h, self.lora_B[name].weight.to(h.dtype))

    def _down(self, name: str, x: torch.Tensor, group: tuple[int, int] | None) -> torch.Tensor:
        """A dropout(x) of one adapter on its rows of x, [rows*seq, r]: its part of the siblings'
        one product when they share it (see the module's docstring)."""
        part = x
        if group is not None:
            rows = x.shape[0] // group[1]
            part = x[group[0] * rows:(group[0] + 1) * rows]
        shared = self._shared_input
        sharing = [k for k, m in enumerate(shared.layers) if name in m.lora_A and not _drops(m.lora_dropout[name])]
        if len(sharing) < 2 or self._sibling_index not in sharing or shared.suspended:
            dropout = self.lora_dropout[name]
            h = dropout(part, group) if isinstance(dropout, SeededDropout) else dropout(part)
            # Two 2-D products on the activations flattened once: F.linear on [batch, seq, in]
            # flattens and restores around each product, operations that XLA traces on the host
            # at every step, forward and backward (14 wrapped 64-wide layers: 6.6 -> 5.2 ms of tracing).
            return h.reshape(-1, self.in_features) @ self.lora_A[name].weight.to(h.dtype).t()
        mine = shared.take(x, name, self._sibling_index)
        if mine is not None:  # a sibling computed it
            return mine
        siblings = [shared.layers[k] for k in sharing]
        a = torch.cat([m.lora_A[name].weight.to(part.dtype) for m in siblings])  # [sum of ranks, in]
        parts = (part.reshape(-1, self.in_features) @ a.t()).split([m.r[name] for m in siblings], dim=1)
        shared.keep(x, name, {k: h for k, h in zip(sharing, parts) if k != self._sibling_index})
        return parts[sharing.index(self._sibling_index)]

    def delta_weight(self, name: str) -> torch.Tensor:
        """scaling * B A of adapter `name` in fp32 (float64 for a float64 LoRA), [out, in]: what
        `merge()` adds to W0."""
        return (at_least_fp32(self.lora_B[name].weight) @ at_least_fp32(self.lora_A[name].weight)) * self.scaling[name]

    def _merged_adapter(self, action: str) -> str | None:
        """The adapter a merge folds in: the one every row goes through (None: it does not adapt
        this layer). Adapters side by side serve different rows, so no one weight holds them."""
        if isinstance(self.base_layer, QuantizedLinear):
            raise ValueError(f"cannot {action} into a {self.base_layer.format} base: it would quantize the update "
                             "away; merge the adapter into the base's full-precision weights (load them unquantized)")
        if len(self.groups) != 1:
            raise ValueError(f"cannot {action} adapters side by side ({', '.join(self.groups)}): each serves its own "
                             "rows; write them (save_adapters) and merge each into a base of its own")
        return self.groups[0] if self.groups[0] in self.lora_A else None

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into W0 (for export/inference). A no-op when already merged."""
        name = self._merged_adapter("merge")
        if self.merged:
            return
        if name is not None:
            self._write_base(at_least_fp32(self.base_layer.weight) + self.delta_weight(name), "merge")
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the update from W0 again. Exact up to rounding in W0's dtype: with a bf16
        base, W0 comes back within one bf16 rounding step, not bitwise."""
        name = self._merged_adapter("unmerge")
        if not self.merged:
            return
        if name is not None:
            self._write_base(at_least_fp32(self.base_layer.weight) - self.delta_weight(name), "unmerge")
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
        each = ", ".join(f"{n}: r={self.r[n]} scaling={self.scaling[n]:g}" for n in self.adapters)
        groups = f" of {self.groups}" if self.groups != self.adapters else ""
        return f"in={self.in_features}, out={self.out_features}, adapters={{{each}}}{groups}, merged={self.merged}"


class _ThinProduct(torch.autograd.Function):
    """h @ b^T ([rows, r] @ [r, out]) whose backward computes b's gradient as h^T dy, [r, out],
    and transposes that small result. Left to itself, XLA folds autograd's transpose into the
    product and computes dy^T h, [out, r], straight: the same sums, in a form XLA:CPU runs
    about 3x slower (4.0 against 1.3 ms with the transpose at the large bench shape, `make
    bench-lora-cost`). An optimization barrier keeps the product as written."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, b)
        return h @ b.t()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        h, b = ctx.saved_tensors
        grad_h = grad_output @ b if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            (grad_b_t,) = barrier_copies(h.t() @ grad_output)
            grad_b = grad_b_t.t()
        return grad_h, grad_b


def _drops(dropout: nn.Module) -> bool:
    """Whether a LoRA dropout draws a mask now (p > 0 and training)."""
    return isinstance(dropout, SeededDropout) and dropout.training


class SharedInput:
    """The LoRALinears that read one input tensor (share_input), and the parts of their one A
    product that the first of them called left for the others: for one input tensor at a time,
    each part until its layer takes it. A plain object the layers hold (torch.compile traces its
    attributes as it traces a module's, where state kept on a tensor breaks it), emptied as the
    last part is taken, so it keeps no activation alive between forwards."""

    def __init__(self, layers: list[LoRALinear]) -> None:
        self.layers = list(layers)
        # Set while the siblings run where nothing may be handed between them (suspended_sharing).
        self.suspended = False
        self._input: torch.Tensor | None = None  # the tensor the parts below were computed from
        self._parts: dict[str, dict[int, torch.Tensor]] = {}  # adapter -> {sibling index: [rows*seq, r]}

    def take(self, x: torch.Tensor, name: str, index: int) -> torch.Tensor | None:
        """Sibling `index`'s part of adapter `name`'s product on this very `x`, or None."""
        if self._input is not x or index not in self._parts.get(name, {}):
            return None
        mine = self._parts[name].pop(index)
        if not self._parts[name]:
            del self._parts[name]
        if not self._parts:
            self._input = None
        return mine

    def keep(self, x: torch.Tensor, name: str, parts: dict[int, torch.Tensor]) -> None:
        """Leave the other siblings' parts of adapter `name`'s product on `x` (parts of another
        input, never taken, are dropped: their layers were called with other tensors)."""
        if self._input is not x:
            self._input, self._parts = x, {}
        self._parts[name] = parts

    def pending(self) -> int:
        """How many parts wait for their layer (0 once every sibling took its own)."""
        return sum(len(parts) for parts in self._parts.values())


def shared_inputs(module: nn.Module) -> list[SharedInput]:
    """The SharedInput of each LoRALinear inside `module` (a decoder layer; siblings' is one, named
    once a sibling: by identity only, no id() that torch.compile would guard on, layer by layer)."""
    return [m._shared_input for m in module.modules() if isinstance(m, LoRALinear)]


def share_input(layers: list[LoRALinear]) -> None:
    """Declare that these layers are always called with the same input tensor (q, k and v of
    one attention): their A products are then computed as one (see the module's docstring).
    A wrong declaration costs time, never correctness: a layer called with another tensor
    computes its own product."""
    shared = SharedInput(layers)
    for index, layer in enumerate(layers):
        layer._shared_input, layer._sibling_index = shared, index
