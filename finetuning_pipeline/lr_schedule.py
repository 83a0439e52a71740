"""Linear warm-up then cosine decay, never exactly 0 (or 1).

On XLA a Python scalar is shipped to the device as data, except 0 and 1, which are baked
into the graph as constants: a schedule that starts at lr = 0 compiles one extra graph for
that step. So warm-up starts at peak / warmup_steps and the decay ends at
peak * min_lr_ratio > 0.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The learning rate of optimizer step `step` (0-based) out of `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps + 1) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
