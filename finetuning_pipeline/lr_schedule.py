"""Linear warm-up then cosine decay, computed on the device from a step-count tensor.

Why on the device: a learning rate sent from the host each step is a Python scalar, and
torch_xla caches scalars as device data keyed by value, so a value that happens to equal
another scalar of the step graph (lr = 0.001 = 1 - beta2 in fp32, seen here) is merged into
that input, which changes the graph and recompiles it. Scalars 0 and 1 are worse: they are
baked in as constants. Computing the rate from a step tensor keeps one graph for every step,
with no per-step host-to-device transfer. The same function serves plain ints (for logs and
tests) and gives the same values.

The schedule never reaches 0: warm-up starts at peak / warmup_steps, the decay ends at
peak * min_lr_ratio > 0.
"""

from __future__ import annotations

import math

import torch


def lr_at(step, *, peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """The learning rate of optimizer step `step` (0-based) out of `total_steps`.

    `step` may be an int (returns a float) or a tensor (returns a tensor on its device)."""
    s = step.to(torch.float32) if isinstance(step, torch.Tensor) else torch.tensor(float(step))
    warm = peak * (s + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = torch.clamp((s - warmup_steps + 1) / decay_steps, max=1.0)
    cosine = 0.5 * (1.0 + torch.cos(math.pi * progress))
    decayed = peak * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
    lr = torch.where(s < warmup_steps, warm, decayed)
    return lr if isinstance(step, torch.Tensor) else float(lr)
