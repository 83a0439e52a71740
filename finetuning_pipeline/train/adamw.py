"""AdamW whose update can be skipped on the device, for the non-finite-loss policy.

Same arithmetic as `torch.optim.AdamW` (decoupled weight decay, bias-corrected moments,
eps added after the square root), with three differences that matter on XLA:
- `step(apply)` takes a boolean device tensor: where it is False, parameters, moments and
  the step count keep their old values (`torch.where`), so a step with a NaN loss changes
  nothing and no host ever has to look at the loss to decide;
- all state, the step count included, lives on the device from construction (the moments as
  two flat vectors), so the first step traces the same graph as every later one (torch's
  AdamW creates its state lazily, which costs one extra graph, and keeps its step count on
  the host);
- `lr` may be a device tensor (the trainer reads it from a schedule table on the device).

A parameter may take its own multiple of the learning rate (`lr_scales`: the modules trained in
full beside the LoRA at train.embedding_lr, a second parameter group of torch's AdamW with the
same schedule: its LR is lr * embedding_lr / peak lr at every step, as a LambdaLR scales each
group's own LR), weight decay included.

Adapters trained side by side (lora_logic/layer.py) share one optimizer in `groups`:
each parameter belongs to a group (its adapter), and `lr`, `apply` and the step count are
per group ([G] tensors), so each adapter steps, skips and warms up as an optimizer of its own
would, in the same flat update.
"""

from __future__ import annotations

import itertools
import math

import torch

from utils.device_ops import barrier_copies
from utils.device_tensors import device_counter, device_zeros


class MaskedAdamW:
    def __init__(self, params: list[torch.nn.Parameter], lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, groups: list[int] | None = None,
                 lr_scales: list[float] | None = None) -> None:
        """groups: each parameter's group (0..G-1), for adapters side by side; None: one group.
        lr_scales: each parameter's multiple of the LR; None: 1 for all."""
        self.params = list(params)
        self.sizes = [p.numel() for p in self.params]
        numbered = groups is None or sorted(set(groups)) == list(range(max(groups) + 1))
        if groups is not None and (len(groups) != len(self.params) or not numbered):
            raise ValueError(f"groups: one group number per parameter, numbered from 0 without gaps; got {groups}")
        self.group_count = max(groups) + 1 if groups else 1
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        device, dtype = self.params[0].device, self.params[0].dtype
        # Updates applied so far, per group; the update's coefficients (bias corrections, the
        # gate) are computed in its dtype: fp32, or float64 for a float64 model's LoRA.
        self.steps = device_zeros(self.group_count, torch.promote_types(dtype, torch.float32), device)
        # The flat vectors hold the parameters by size: those of n elements one after another,
        # a [count, n] block of which each is a row (see _write_back).
        self.order = sorted(range(len(self.params)), key=lambda i: self.sizes[i])
        flat_sizes = [self.sizes[i] for i in self.order]
        starts = dict(zip(self.order, itertools.accumulate([0] + flat_sizes)))
        self.blocks: dict[int, tuple[int, int]] = {}  # size -> (its block's start, how many parameters)
        for size, members in itertools.groupby(self.order, key=lambda i: self.sizes[i]):
            members = list(members)
            self.blocks[size] = (starts[members[0]], len(members))
        # Each parameter's row in its block, its own [1] tensor of data, not a constant baked into the graph.
        self.rows = [device_counter((starts[i] - self.blocks[size][0]) // size, device, torch.int32)
                     for i, size in enumerate(self.sizes)]
        # The row length each size's parameters are summed in by group_norms.
        self.norm_rows = {size: row_length(size) for size in self.blocks}
        # Each parameter's group, in the flat order: to spread a group's values over its
        # parameters' elements and to sum its squares (G > 1 only: one group keeps its scalar
        # arithmetic and its graph).
        self.param_group = None
        if self.group_count > 1:
            self.param_group = torch.tensor([groups[i] for i in self.order]).to(device)
        # The moments of all parameters as one flat vector each: the update is then a dozen
        # operations on two vectors instead of a dozen per parameter (on XLA every operation
        # is traced on the host each step: 8.6 of a 42 ms step on the small benchmark model).
        self.exp_avg_flat = device_zeros(sum(self.sizes), dtype, device)
        self.exp_avg_sq_flat = device_zeros(sum(self.sizes), dtype, device)
        # Each parameter's LR multiple, in the flat order (data, not constants baked into the graph);
        # None where all are 1: the update's graph is then what it was without them.
        self.lr_scales = None
        if lr_scales is not None and any(scale != 1 for scale in lr_scales):
            if len(lr_scales) != len(self.params):
                raise ValueError(f"lr_scales: one per parameter ({len(self.params)}), got {len(lr_scales)}")
            self.lr_scales = torch.tensor([float(lr_scales[i]) for i in self.order],
                                          dtype=self.steps.dtype).to(device)

    def _flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One tensor per parameter, in parameter order -> the flat layout."""
        return torch.cat([tensors[i].reshape(-1) for i in self.order])

    def _unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        chunks = dict(zip(self.order, torch.split(flat, [self.sizes[i] for i in self.order])))
        return [chunks[i].view(p.shape) for i, p in enumerate(self.params)]

    @property
    def exp_avg(self) -> list[torch.Tensor]:
        return self._unflatten(self.exp_avg_flat)

    @property
    def exp_avg_sq(self) -> list[torch.Tensor]:
        return self._unflatten(self.exp_avg_sq_flat)

    def flat_grad(self) -> torch.Tensor:
        """Every parameter's `.grad` in the flat layout (the parameters by size)."""
        return self._flatten([p.grad for p in self.params])

    @torch.no_grad()
    def step(self, apply: torch.Tensor | None = None, grad: torch.Tensor | None = None) -> None:
        """One update; skipped wherever `apply` is False. `grad`: the flat gradient (as
        `flat_grad()` lays it out) when the caller already built it, else the `.grad`s.

        A skipped step multiplies the update by 0; the gradient is first made NaN-free, and
        the bias correction uses at least one step, so that 0 never meets NaN or inf.
        """
        device = self.steps.device
        shape = (self.group_count,) if self.group_count > 1 else ()
        if apply is None:
            apply = torch.ones(shape, dtype=torch.bool, device=device)
        g = self.flat_grad() if grad is None else grad
        gate = apply.to(self.steps.dtype).reshape(shape)  # 1.0 applies the update, 0.0 keeps all as it is
        lr = self.lr.reshape(shape) if isinstance(self.lr, torch.Tensor) else self.lr
        steps = self.steps.reshape(shape) + gate
        counted = torch.clamp(steps, min=1.0)
        bias_correction1 = 1 - self.beta1 ** counted
        bias_correction2_sqrt = torch.sqrt(1 - self.beta2 ** counted)
        each = self.per_element
        g = torch.where(each(apply), g, torch.zeros_like(g))
        # m += (1 - beta1) * gate * (g - m);  v += (1 - beta2) * gate * (g^2 - v)
        self.exp_avg_flat.add_((g - self.exp_avg_flat) * each(gate * (1 - self.beta1)))
        self.exp_avg_sq_flat.add_((g * g - self.exp_avg_sq_flat) * each(gate * (1 - self.beta2)))
        # p -= gate * (lr * wd * p + lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps))
        denom = torch.sqrt(self.exp_avg_sq_flat) / each(bias_correction2_sqrt) + self.eps
        update = self.exp_avg_flat / denom * each(gate * lr / bias_correction1)
        flat_params = self._flatten(self.params)
        if self.weight_decay:
            update = update + flat_params * each(gate * lr * self.weight_decay)
        if self.lr_scales is not None:
            update = update * self.spread(self.lr_scales).to(update.dtype)
        self._write_back(flat_params - update)
        self.steps.copy_(steps.reshape(self.group_count))

    def _write_back(self, flat: torch.Tensor) -> None:
        """Copy each parameter's part of `flat` into it: the row of its size's block, at a row
        number held as data. Read at a constant offset, each parameter's part would be a kernel
        of its own for XLA to compile (a slice); one row read at a number that is a graph
        parameter is a dynamic-slice, the same kernel for all parameters of one shape (XLA:CPU
        compiles identical kernels once: docs/benchmarks.md, "The LoRA's own cost and the
        compile"). The values are the same either way: a read is a copy."""
        for param, row in zip(self.params, self.rows):
            first, count = self.blocks[param.numel()]
            block = flat[first:first + count * param.numel()].view(count, param.numel())
            param.copy_(block.index_select(0, row).view(param.shape))

    def per_element(self, values: torch.Tensor) -> torch.Tensor:
        """A group's value on each of its flat elements (the values themselves for one group).

        Each parameter's value broadcast over its row of its size's block: XLA fuses the
        broadcasts into the arithmetic that reads them, where an index per element (a gather)
        would keep a vector as long as the LoRA on the device (8 bytes an element in int64)."""
        if self.param_group is None:
            return values
        return self.spread(values[self.param_group])

    def spread(self, each_parameter: torch.Tensor) -> torch.Tensor:
        """A value per parameter (in the flat order) on each of its flat elements."""
        starts = itertools.accumulate([0] + [count for _, count in self.blocks.values()])
        return torch.cat([each_parameter[start:start + count, None].expand(count, size).reshape(-1)
                          for start, (size, (_, count)) in zip(starts, self.blocks.items())])

    def group_norms(self, flat: torch.Tensor) -> torch.Tensor:
        """The L2 norm of each group's part of a flat vector (the flat layout): 0-dim for one
        group, else [G]. The gradient norm, which clipping and the logs read.

        Its squares are summed in three short sums rather than one long one: each parameter's
        rows of about sqrt(n) elements, then each parameter's row sums, then the parameters'
        sums. XLA:CPU sums one reduction in a few lanes of running sums (without the tree
        reduction rewriter, which runtime/xla/device turns off for compile time), and its error
        grows with the length: the norm of 8M values is off by 2.4e-5 relative to float64 as one
        sum, 1.5e-7 in levels (docs/benchmarks.md). XLA merges a sum of sums into one sum, so
        an optimization barrier keeps each level's results apart. The values are the same sums
        in another order."""
        blocks = list(self.blocks.items())
        rows = [flat[first:first + count * size].view(-1, self.norm_rows[size]) for size, (first, count) in blocks]
        row_sums = barrier_copies(*[(r * r).sum(1) for r in rows])
        param_sums = barrier_copies(*[s.view(count, -1).sum(1) for s, (_, (_, count)) in zip(row_sums, blocks)])
        squares = torch.cat(param_sums)  # one per parameter, in the flat order
        if self.param_group is None:
            return torch.sqrt(squares.sum())
        zeros = torch.zeros(self.group_count, dtype=flat.dtype, device=flat.device)
        return torch.sqrt(zeros.index_add(0, self.param_group, squares))

    def device_constants(self) -> list[torch.Tensor]:
        """What the update reads besides state and gradients: each parameter's row in its block,
        and side by side each parameter's group."""
        return (self.rows + ([] if self.param_group is None else [self.param_group])
                + ([] if self.lr_scales is None else [self.lr_scales]))

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.steps, self.exp_avg_flat, self.exp_avg_sq_flat]

    def zero_grad(self) -> None:
        """Drop the gradients (set to None, as torch's optimizers do by default): the next
        backward creates them inside its graph, so they are neither graph inputs nor outputs."""
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        """On the host, with per-parameter moments (the checkpoint format does not depend on the
        flat layout). Each flat vector crosses to the host once and is split there: `.cpu()` of
        each device-side slice would compile a small graph per parameter."""
        exp_avg, exp_avg_sq = ([t.clone() for t in self._unflatten(flat.cpu())]
                               for flat in (self.exp_avg_flat, self.exp_avg_sq_flat))
        return {"steps": self.steps.cpu(), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                "hyper": {"betas": [self.beta1, self.beta2], "eps": self.eps, "weight_decay": self.weight_decay}}

    def load_state_dict(self, state: dict) -> None:
        if len(state["exp_avg"]) != len(self.params):
            raise ValueError(
                f"optimizer state has {len(state['exp_avg'])} tensors, the model {len(self.params)} parameters"
            )
        for saved, param in zip(state["exp_avg"] + state["exp_avg_sq"], self.params + self.params):
            if saved.shape != param.shape:
                raise ValueError(f"optimizer state shape {tuple(saved.shape)} does not match {tuple(param.shape)}")
        with torch.no_grad():
            self.steps.copy_(state["steps"].to(self.steps.device))
            for target, saved in ((self.exp_avg_flat, state["exp_avg"]), (self.exp_avg_sq_flat, state["exp_avg_sq"])):
                flat = self._flatten(saved).to(dtype=target.dtype)
                target.copy_(flat.to(target.device))


def row_length(size: int) -> int:
    """The divisor of `size` nearest its square root from above: a parameter of `size` elements
    summed as size / row rows of this length makes two sums of about sqrt(size) each."""
    rows = max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
    return size // rows
