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
        """One update from the parameters' `.grad`; skipped wherever `apply` is False."""
        if apply is None:
            apply = torch.ones((), dtype=torch.bool, device=self.steps.device)
        steps = self.steps + apply.to(torch.float32)
        bias_correction1 = 1 - self.beta1 ** steps
        bias_correction2_sqrt = torch.sqrt(1 - self.beta2 ** steps)
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            grad = torch.where(apply, p.grad, torch.zeros_like(p.grad))  # keeps NaN out of the moments
            new_m = m * self.beta1 + grad * (1 - self.beta1)
            new_v = v * self.beta2 + grad * grad * (1 - self.beta2)
            denom = torch.sqrt(new_v) / bias_correction2_sqrt + self.eps
            new_p = p * (1 - self.lr * self.weight_decay) - (self.lr / bias_correction1) * new_m / denom
            p.copy_(torch.where(apply, new_p, p))
            m.copy_(torch.where(apply, new_m, m))
            v.copy_(torch.where(apply, new_v, v))
        self.steps.copy_(steps)

    def zero_grad(self) -> None:
        """Zero the gradient buffers in place (keeping them: same graph every step)."""
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

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
