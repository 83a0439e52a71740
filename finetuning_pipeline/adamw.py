"""AdamW whose update can be skipped on the device, for the non-finite-loss policy.

Same arithmetic as `torch.optim.AdamW` (decoupled weight decay, bias-corrected moments,
eps added after the square root), with two differences that matter on XLA:
- `step(apply)` takes a boolean device tensor: where it is False, parameters, moments and
  the step count keep their old values (`torch.where`), so a step with a NaN loss changes
  nothing and no host ever has to look at the loss to decide;
- all state, the step count included, lives on the device from construction, so the first
  step traces the same graph as every later one (torch's AdamW creates its state lazily,
  which costs one extra graph, and keeps its step count on the host);
- `lr` may be a device tensor (the trainer's schedule computes it on the device).
"""

from __future__ import annotations

import torch


class MaskedAdamW:
    def __init__(self, params: list[torch.nn.Parameter], lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        self.params = list(params)
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        device = self.params[0].device
        # Created on the host and transferred, so they reach the device as data: zeros made
        # on an XLA device would be a fill op compiled into the first step's graph. The step
        # count is [1], not 0-dim: a 0-dim 0 is baked into graphs as a constant.
        self.steps = torch.zeros(1, dtype=torch.float32).to(device)  # updates applied so far
        self.exp_avg = [torch.zeros(p.shape, dtype=p.dtype).to(device) for p in self.params]
        self.exp_avg_sq = [torch.zeros(p.shape, dtype=p.dtype).to(device) for p in self.params]

    @torch.no_grad()
    def step(self, apply: torch.Tensor | None = None) -> None:
        """One update from the parameters' `.grad`; skipped wherever `apply` is False.

        Written with `torch._foreach_*` ops (one dispatch per operation for all parameters, not
        one per parameter: on XLA the Python dispatch is a large part of a small model's step).
        A skipped step multiplies the update by 0; the gradients are first made NaN-free, and
        the bias correction uses at least one step, so that 0 never meets NaN or inf.
        """
        device = self.steps.device
        if apply is None:
            apply = torch.ones((), dtype=torch.bool, device=device)
        # foreach ops take 0-dim tensor scalars; the stored counters are [1] (see __init__).
        gate = apply.to(torch.float32).reshape(())  # 1.0 applies the update, 0.0 keeps all as it is
        lr = self.lr.reshape(()) if isinstance(self.lr, torch.Tensor) else self.lr
        steps = self.steps.reshape(()) + gate
        counted = torch.clamp(steps, min=1.0)
        bias_correction1 = 1 - self.beta1 ** counted
        bias_correction2_sqrt = torch.sqrt(1 - self.beta2 ** counted)
        grads = [torch.where(apply, p.grad, torch.zeros_like(p.grad)) for p in self.params]
        # m += (1 - beta1) * gate * (g - m);  v += (1 - beta2) * gate * (g^2 - v)
        delta_m = torch._foreach_sub(grads, self.exp_avg)
        torch._foreach_mul_(delta_m, gate * (1 - self.beta1))
        torch._foreach_add_(self.exp_avg, delta_m)
        delta_v = torch._foreach_mul(grads, grads)
        torch._foreach_sub_(delta_v, self.exp_avg_sq)
        torch._foreach_mul_(delta_v, gate * (1 - self.beta2))
        torch._foreach_add_(self.exp_avg_sq, delta_v)
        # p -= gate * (lr * wd * p + lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps))
        denom = torch._foreach_sqrt(self.exp_avg_sq)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, self.eps)
        update = torch._foreach_div(self.exp_avg, denom)
        torch._foreach_mul_(update, gate * lr / bias_correction1)
        if self.weight_decay:
            torch._foreach_add_(update, torch._foreach_mul(self.params, gate * lr * self.weight_decay))
        torch._foreach_sub_(self.params, update)
        self.steps.copy_(steps.reshape(1))

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.steps, *self.exp_avg, *self.exp_avg_sq]

    def zero_grad(self) -> None:
        """Zero the gradient buffers in place (keeping them: same graph every step)."""
        torch._foreach_zero_([p.grad for p in self.params if p.grad is not None])

    def state_dict(self) -> dict:
        return {"steps": self.steps, "exp_avg": list(self.exp_avg), "exp_avg_sq": list(self.exp_avg_sq),
                "hyper": {"betas": [self.beta1, self.beta2], "eps": self.eps, "weight_decay": self.weight_decay}}

    def load_state_dict(self, state: dict) -> None:
        if len(state["exp_avg"]) != len(self.params):
            raise ValueError(f"optimizer state has {len(state['exp_avg'])} tensors, the model {len(self.params)} parameters")
        with torch.no_grad():
            self.steps.copy_(state["steps"].to(self.steps.device))
            for target, saved in zip(self.exp_avg + self.exp_avg_sq, state["exp_avg"] + state["exp_avg_sq"]):
                if target.shape != saved.shape:
                    raise ValueError(f"optimizer state shape {tuple(saved.shape)} does not match {tuple(target.shape)}")
                target.copy_(saved.to(device=target.device, dtype=target.dtype))
