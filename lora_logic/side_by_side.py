"""Several adapters trained side by side over one frozen base: `SideBySideLoRALinear`.

A batch's rows are K equal groups, one per adapter of the model, in the adapters' order;
group k goes through adapter k's A and B where adapter k adapts the layer (a layer only some
adapters target leaves the others' rows to the base), and every row through the frozen base
weight once, so the
base's weights are read once for all K adapters (what makes a small-batch step, bound by
reading those weights, cheaper than K steps of K models):

    y = W0 x + b0                                                   (all K*b rows at once)
    y[k*b:(k+1)*b] += scaling_k * B_k A_k dropout_k(x[k*b:(k+1)*b])  (each adapter its rows)

Each adapter has its own r, alpha, dropout and parameters (`lora_A[name]`, `lora_B[name]`,
PEFT's own in-memory layout of several adapters), so its gradients are those of its own rows'
loss only, and each is saved as a PEFT adapter of its own (`adapter_state_dict`). An adapter's
dropout has the salt a single-adapter model gives the layer and sees a [b, ...] slice, so it
draws the masks training that adapter alone draws (lora_logic/dropout.py).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from lora_logic.adapter_io import PEFT_PREFIX, WEIGHTS_NAME, read_weights_file, write_adapter
from lora_logic.config import LoraConfig, lora_scaling
from lora_logic.dropout import SeededDropout
from lora_logic.inject import matches_target
from lora_logic.layer import init_lora_A_, init_lora_B_
from lora_logic.layer_scan import ScannedLayers


class SideBySideLoRALinear(nn.Module):
    """A frozen `nn.Linear` with LoRA adapters side by side. `groups`: every adapter of the
    model, in the order of their rows in a batch (the same in every layer); this layer adapts
    those of them added here."""

    def __init__(self, base_layer: nn.Linear, groups: list[str]) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"SideBySideLoRALinear wraps nn.Linear, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.groups = list(groups)
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        for p in self.base_layer.parameters():
            p.requires_grad_(False)

    @property
    def adapters(self) -> list[str]:
        return list(self.lora_A)

    def add_adapter(self, name: str, config: LoraConfig, dropout_salt: int = 0,
                    lora_dtype: torch.dtype = torch.float32) -> None:
        """A new adapter, initialised as LoRALinear initialises one (A Kaiming-uniform from
        torch's generator, B zeros): seed the generator as for a single-adapter run first.
        dropout_salt: the layer's salt in a model of this adapter alone (inject_lora's)."""
        if name in self.lora_A or name not in self.groups:
            raise ValueError(f"adapter {name!r}: already here, or not one of the model's adapters {self.groups}")
        device = self.base_layer.weight.device
        self.lora_A[name] = nn.Linear(self.in_features, config.r, bias=False, device=device, dtype=lora_dtype)
        self.lora_B[name] = nn.Linear(config.r, self.out_features, bias=False, device=device, dtype=lora_dtype)
        init_lora_A_(self.lora_A[name].weight)
        init_lora_B_(self.lora_B[name].weight)
        self.lora_dropout[name] = (SeededDropout(config.dropout, dropout_salt) if config.dropout > 0
                                   else nn.Identity())
        self.scaling[name] = lora_scaling(config.alpha, config.r, config.use_rslora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)  # every adapter's rows at once: the base's weights read once
        rows = x.shape[0] // len(self.groups)
        if rows * len(self.groups) != x.shape[0]:
            raise ValueError(f"{x.shape[0]} rows do not split into {len(self.groups)} equal groups, one per adapter "
                             f"({', '.join(self.groups)})")
        out = []
        for k, name in enumerate(self.groups):
            y_k = y[k * rows:(k + 1) * rows]
            if name in self.lora_A:
                h = self.lora_dropout[name](x[k * rows:(k + 1) * rows])
                a = self.lora_A[name].weight.to(h.dtype)  # [r, in]
                b = (self.lora_B[name].weight * self.scaling[name]).to(h.dtype)  # [out, r]
                y_k = y_k + ((h.reshape(-1, self.in_features) @ a.t()) @ b.t()).view(y_k.shape)
            out.append(y_k)
        return torch.cat(out)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, adapters={self.adapters} of {self.groups}"


def inject_side_by_side(model: nn.Module, adapters: dict[str, LoraConfig]) -> list[str]:
    """Wrap the union of the adapters' target layers in SideBySideLoRALinear and give each layer
    the adapters that target it, adapter by adapter: torch's generator is put back to its state
    on entry before each adapter, so each adapter starts as `inject_lora` here would start it
    alone. Freezes everything else; returns the wrapped names."""
    linear_names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    wanted = {name: [t for t in config.target_modules if not any(matches_target(n, t) for n in linear_names)]
              for name, config in adapters.items()}
    for name, unmatched in wanted.items():
        if unmatched:
            raise ValueError(f"adapter {name}: target_modules {unmatched} match no nn.Linear in "
                             f"{type(model).__name__}")
    targets = {name: [n for n in linear_names if any(matches_target(n, t) for t in config.target_modules)]
               for name, config in adapters.items()}
    to_wrap = [n for n in linear_names if any(n in names for names in targets.values())]
    for param in model.parameters():
        param.requires_grad_(False)
    wrapped = {}
    for name in to_wrap:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child_name)
        wrapped[name] = SideBySideLoRALinear(base, list(adapters))
        wrapped[name].train(base.training)
        setattr(parent, child_name, wrapped[name])
    rng = torch.get_rng_state()
    for adapter, config in adapters.items():
        torch.set_rng_state(rng)
        for salt, name in enumerate(targets[adapter]):  # inject_lora's salt: the index among its targets
            wrapped[name].add_adapter(adapter, config, dropout_salt=salt)
    return to_wrap


def side_by_side_modules(model: nn.Module) -> list[tuple[str, SideBySideLoRALinear]]:
    """The model's SideBySideLoRALinear layers, those of scanned layers' template too (it holds
    their settings, not their weights: see layer_scan.py)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, SideBySideLoRALinear):
            found.append((name, module))
        elif isinstance(module, ScannedLayers):
            found += [(f"{name}.<template>.{n}", m) for n, m in module.template.named_modules()
                      if isinstance(m, SideBySideLoRALinear)]
    return found


def adapter_of(parameter_name: str) -> str:
    """The adapter of a side-by-side weight, from its name ("...q_proj.lora_A.<adapter>.weight")."""
    parts = parameter_name.split(".")
    where = max(i for i, part in enumerate(parts) if part in ("lora_A", "lora_B"))
    return parts[where + 1]


def lora_parameters_by_adapter(model: nn.Module) -> tuple[list[nn.Parameter], list[str]]:
    """The model's trainable LoRA weights in module order (layer_scan's layout: a scanned
    stack each, per_layer_lora's order unscanned), and the adapter of each."""
    params, owners = [], []
    for _, module in model.named_modules():
        if isinstance(module, SideBySideLoRALinear):
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        elif isinstance(module, ScannedLayers):
            named = list(zip(module.lora_names, module.lora_parameters()))
        else:
            continue
        params += [p for _, p in named]
        owners += [adapter_of(n) for n, _ in named]
    return params, owners


def adapter_parameters(model: nn.Module, adapter: str) -> list[nn.Parameter]:
    """One adapter's trainable weights (A then B of each layer it adapts), in layer order."""
    params, owners = lora_parameters_by_adapter(model)
    return [p for p, owner in zip(params, owners) if owner == adapter]


def adapter_state_dict(model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """One adapter's weights under the names a model of it alone has (lora_state_dict's
    "<module path>.lora_A.weight"), so adapter_io writes it as a PEFT adapter of its own.
    Scanned layers give each layer's weights, as host copies (ScannedLayers.lora_state_dict)."""
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, SideBySideLoRALinear) and adapter in module.lora_A:
            state[f"{name}.lora_A.weight"] = module.lora_A[adapter].weight.detach()
            state[f"{name}.lora_B.weight"] = module.lora_B[adapter].weight.detach()
        elif isinstance(module, ScannedLayers):
            for key, tensor in module.lora_state_dict(name).items():
                if adapter_of(key) == adapter:
                    state[key.replace(f".{adapter}.weight", ".weight")] = tensor
    return state


def adapter_names(model: nn.Module) -> list[str]:
    """The adapters of a model with adapters side by side, in their rows' order ([] without)."""
    modules = side_by_side_modules(model)
    return list(modules[0][1].groups) if modules else []


@contextlib.contextmanager
def only_adapter(model: nn.Module, adapter: str):
    """Within: every row goes through `adapter` alone (evaluating or generating with one
    adapter of several), as a model of that adapter alone."""
    modules = [m for _, m in side_by_side_modules(model)]
    saved = [m.groups for m in modules]
    for module in modules:
        module.groups = [adapter]
    try:
        yield model
    finally:
        for module, groups in zip(modules, saved):
            module.groups = groups


def save_side_by_side(model: nn.Module, directory: str | os.PathLike, configs: dict[str, LoraConfig],
                      base_model_name_or_path: str, revision: str | None = None) -> dict[str, Path]:
    """Each adapter as a PEFT adapter of its own, `directory/<name>/`; returns the directories."""
    return {name: write_adapter(Path(directory) / name,
                                {k: t.to("cpu").contiguous() for k, t in adapter_state_dict(model, name).items()},
                                config, base_model_name_or_path, revision)
            for name, config in configs.items()}


def load_side_by_side(model: nn.Module, directory: str | os.PathLike) -> None:
    """The weights `save_side_by_side` wrote into the model's adapters of the same names; a
    missing, unexpected or misshapen tensor is a ValueError naming the file, before anything is loaded."""
    loaded = {}
    for name in adapter_names(model):
        path = Path(directory) / name / WEIGHTS_NAME
        tensors = read_weights_file(path)
        expected = {PEFT_PREFIX + k: t for k, t in adapter_state_dict(model, name).items()}
        wrong = sorted(set(tensors) ^ set(expected)) + sorted(
            k for k in set(tensors) & set(expected) if tensors[k].shape != expected[k].shape)
        if wrong:
            raise ValueError(f"{path} does not fit adapter {name!r} of this model: {len(wrong)} missing, unexpected "
                             f"or misshapen tensors (first {wrong[0]!r})")
        loaded[name] = (expected, tensors)
    with torch.no_grad():
        for expected, tensors in loaded.values():
            for key, param in expected.items():
                param.copy_(tensors[key].to(dtype=param.dtype))
