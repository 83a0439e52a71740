"""Linear warm-up then cosine decay, as a table of every step's rate that lives on the device.

Why a table on the device: a learning rate sent from the host each step is a Python scalar,
and torch_xla caches scalars as device data keyed by value, so a value that happens to equal
another scalar of the step graph (lr = 0.001 = 1 - beta2 in fp32, seen here) is merged into
that input, which changes the graph and recompiles it. Scalars 0 and 1 are worse: they are
baked in as constants. Indexing a device table with the step-count tensor keeps one graph for
every step, with no per-step host-to-device transfer, and it is one gather where computing
the schedule on the device was a dozen operations traced at every step (0.7 ms of a 25 ms
step on the small benchmark model).

The schedule never reaches 0: warm-up starts at peak / warmup_steps, the decay ends at
peak * min_lr_ratio > 0.
"""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The learning rate of optimizer step `step` (0-based) out of `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps + 1) / max(1, total_steps - warmup_steps))
    return peak * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def lr_table(*, peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> torch.Tensor:
    """[total_steps] fp32: entry k is `lr_at(k, ...)`. Index it with the step count."""
    return torch.tensor([lr_at(k, peak=peak, warmup_steps=warmup_steps, total_steps=total_steps,
                               min_lr_ratio=min_lr_ratio) for k in range(total_steps)], dtype=torch.float32)
