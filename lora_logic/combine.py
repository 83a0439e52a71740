"""Several adapters of one base combined into one, as PEFT's `add_weighted_adapter` combines
them (peft 0.21: `tuners/lora/model.py`, `utils/merge_utils.py`), without PEFT.

The combined adapter has rank r (below) and alpha = r, like PEFT's, so its scaling is 1 (the
first adapter's use_rslora carries over, as in PEFT). Per module, over the adapters that
adapt it, with weights w_i and scalings s_i:

  linear       A = sum(sign(w_i s_i) sqrt|w_i s_i| A_i), B = sum(sqrt|w_i s_i| B_i): one rank for all.
               (The product is not sum(w_i s_i B_i A_i): PEFT calls it "a very rough approximation".)
  cat          A = [w_1 s_1 A_1; w_2 s_2 A_2; ...], B = [B_1, B_2, ...]: r = the sum of the ranks,
               and B A = sum(w_i s_i B_i A_i) exactly.
  svd          delta = sum(w_i s_i B_i A_i), truncated to rank r (default: the largest rank) by SVD.
  ties         linear's weighting, each A_i (and each B_i) first pruned to its `density` largest
               magnitudes, then per entry only the values of the majority sign kept and averaged.
  dare_linear  linear, each A_i and B_i first dropped at random (kept with probability
               `density`) and rescaled by 1 / density.
  dare_ties    ties with DARE's random drop instead of the magnitude pruning.

With one adapter every method is linear (PEFT's rule).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lora_logic.config import LoraConfig

COMBINE_METHODS = ("linear", "cat", "svd", "ties", "dare_linear", "dare_ties")
ONE_RANK = ("linear", "ties", "dare_linear", "dare_ties")
PRUNED = ("ties", "dare_linear", "dare_ties")


@dataclass
class Adapter:
    """An adapter read from disk: how the user named it, its config, {module: (A [r, in], B [out, r])}."""

    name: str
    config: LoraConfig
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def check_combination(adapters: list[Adapter], weights: list[float], method: str, density: float | None,
                      svd_rank: int | None = None) -> str:
    """The method that will run (linear for one adapter); ValueError naming what does not fit."""
    if method not in COMBINE_METHODS:
        raise ValueError(f"--combine must be one of {', '.join(COMBINE_METHODS)}, got {method!r}")
    if len(weights) != len(adapters):
        raise ValueError(f"--weights has {len(weights)} values for {len(adapters)} adapters; give one per --adapter")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"--weights {','.join(map(str, weights))}: every weight must be a finite number")
    for adapter in adapters:
        for module, pair in adapter.modules.items():
            if not all(bool(torch.isfinite(t).all()) for t in pair):
                raise ValueError(f"{adapter.name}: {module} holds NaN/inf weights; the adapter is corrupt (its "
                                 "training diverged?) and would make the combination NaN")
    method = "linear" if len(adapters) == 1 else method
    ranks = {a.name: a.config.r for a in adapters}
    if method in ONE_RANK and len(set(ranks.values())) > 1:
        listed = ", ".join(f"r={r} ({name})" for name, r in ranks.items())
        raise ValueError(f"--combine {method} needs adapters of one rank, got {listed}; cat and svd take "
                         "different ranks")
    if method in PRUNED and density is None:
        raise ValueError(f"--combine {method} needs --density (the fraction of each matrix kept, in (0, 1])")
    if density is not None and (method not in PRUNED or not 0 < density <= 1):
        raise ValueError(f"--density {density}: it applies to {', '.join(PRUNED)} only, in (0, 1]")
    if svd_rank is not None and (method != "svd" or svd_rank < 1):
        raise ValueError(f"--svd-rank {svd_rank}: it applies to --combine svd only, and is at least 1")
    shapes: dict[str, tuple[tuple[int, int], str]] = {}
    for adapter in adapters:
        for module, (lora_a, lora_b) in adapter.modules.items():
            shape = (lora_b.shape[0], lora_a.shape[1])  # (out, in) of the adapted layer
            seen = shapes.setdefault(module, (shape, adapter.name))
            if seen[0] != shape:
                raise ValueError(f"{module}: {seen[1]} adapts a [{seen[0][0]}, {seen[0][1]}] layer, {adapter.name} a "
                                 f"[{shape[0]}, {shape[1]}] one: adapters of different bases")
    if svd_rank is not None:
        most = min(min(shape) for shape, _ in shapes.values())  # the rank of the smallest layer's update
        if svd_rank > most:
            raise ValueError(f"--svd-rank {svd_rank}: the smallest adapted layer's update has rank {most} at most; "
                             f"give at most {most}")
    return method


def combine_adapters(adapters: list[Adapter], weights: list[float], method: str, *, density: float | None = None,
                     svd_rank: int | None = None, generator: torch.Generator | None = None
                     ) -> tuple[LoraConfig, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(config, {module: (A, B)}) of the combined adapter; see the module docstring. `generator`
    draws DARE's drops (seed it for a reproducible combination)."""
    method = check_combination(adapters, weights, method, density, svd_rank)
    ranks = [a.config.r for a in adapters]
    svd_rank = max(ranks) if svd_rank is None else svd_rank
    rank = sum(ranks) if method == "cat" else svd_rank if method == "svd" else ranks[0]
    targets = list(dict.fromkeys(t for a in adapters for t in a.config.target_modules))
    config = dataclasses.replace(adapters[0].config, r=rank, alpha=float(rank), target_modules=targets)
    modules = {}
    for module in dict.fromkeys(m for a in adapters for m in a.modules):
        present = [(a.modules[module], w * a.config.scaling) for a, w in zip(adapters, weights) if module in a.modules]
        pairs = [pair for pair, _ in present]
        scaled = [w for _, w in present]
        if method == "cat":
            modules[module] = _cat(pairs, scaled, rank)
        elif method == "svd":
            modules[module] = _svd(pairs, scaled, rank)
        else:
            modules[module] = _task_arithmetic(pairs, scaled, method, density, generator)
    return config, modules


def _cat(pairs, scaled, rank):
    lora_a = torch.cat([a * w for (a, _), w in zip(pairs, scaled)], dim=0)
    lora_b = torch.cat([b for _, b in pairs], dim=1)
    short = rank - lora_a.shape[0]  # a module some adapters leave alone: their rows stay zero (as in PEFT)
    return (torch.nn.functional.pad(lora_a, (0, 0, 0, short)), torch.nn.functional.pad(lora_b, (0, short)))


def _svd(pairs, scaled, rank):
    delta = sum(w * (b @ a) for (a, b), w in zip(pairs, scaled))
    u, s, vh = torch.linalg.svd(delta, full_matrices=True)
    return vh[:rank, :], u[:, :rank] @ torch.diag(s[:rank])


def _task_arithmetic(pairs, scaled, method, density, generator):
    """PEFT's weighting of A and B (the sign on A only), then the method on A's and on B's."""
    weights_a = torch.tensor([math.copysign(math.sqrt(abs(w)), w) for w in scaled])
    weights_b = torch.tensor([math.sqrt(abs(w)) for w in scaled])
    lora_a = _merge([a for a, _ in pairs], weights_a, method, density, generator)
    lora_b = _merge([b for _, b in pairs], weights_b, method, density, generator)
    return lora_a, lora_b


def _merge(tensors: list[torch.Tensor], weights: torch.Tensor, method: str, density, generator) -> torch.Tensor:
    if method in ("ties", "dare_ties", "dare_linear") and density < 1:
        prune = magnitude_prune if method == "ties" else lambda t, d: random_prune(t, d, generator)
        tensors = [prune(t, density) for t in tensors]
    stacked = torch.stack(tensors)
    weighted = stacked * weights.to(stacked.dtype).view(-1, *([1] * (stacked.dim() - 1)))
    if method in ("linear", "dare_linear"):
        return weighted.sum(dim=0)
    # TIES: per entry, the sign with the larger total (of the unweighted values), then the mean of
    # the weighted values of that sign.
    majority = torch.where(stacked.sum(dim=0) >= 0, 1.0, -1.0)
    agree = stacked.sign() == majority
    return (weighted * agree).sum(dim=0) / agree.sum(dim=0).clamp(min=1)


def magnitude_prune(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """The int(density * numel) entries of largest magnitude kept, the rest zero."""
    keep = int(density * tensor.numel())
    mask = torch.zeros(tensor.numel(), dtype=tensor.dtype)
    mask[torch.topk(tensor.abs().reshape(-1), k=keep).indices] = 1
    return tensor * mask.reshape(tensor.shape)


def random_prune(tensor: torch.Tensor, density: float, generator: torch.Generator | None) -> torch.Tensor:
    """DARE: each entry kept with probability `density`, and rescaled by 1 / density."""
    keep = torch.bernoulli(torch.full_like(tensor, density), generator=generator)
    return tensor * keep / density
