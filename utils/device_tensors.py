"""Small tensors made for a device, and values read back from it, in the form every runtime's
compiler takes as data rather than as constants of its graph."""

from __future__ import annotations

import torch


def device_zeros(shape, dtype, device) -> torch.Tensor:
    """Zeros made on the host and transferred, so they reach the device as data: zeros made on
    a lazy device (XLA) are a fill op compiled into the next graph (an extra graph for the first
    step). Keep counters [1]-shaped: a 0-dim 0 or 1 is baked into graphs as a constant."""
    return torch.zeros(shape, dtype=dtype).to(device)


def device_counter(value: float, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A [1]-shaped counter (fp32 unless told) starting at `value`, made on the host like
    device_zeros (data, not a constant baked into the graph)."""
    return torch.tensor([float(value)], dtype=dtype).to(device)


def to_host(*tensors: torch.Tensor) -> list:
    """Values of materialised device tensors, by plain transfers: a float for a one-element
    tensor, a list of floats for a longer one (a value per adapter side by side).
    (`torch.stack(...).cpu()` would first compile and run a small graph of its own on XLA.)"""
    values = [t.cpu() for t in tensors]
    return [v.item() if v.numel() == 1 else v.tolist() for v in values]
