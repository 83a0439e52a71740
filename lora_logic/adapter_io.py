"""Save and load adapters in PEFT's on-disk layout, so PEFT and vLLM read them unchanged.

Layout of an adapter directory:
  adapter_config.json        PEFT's LoraConfig fields (`LoraConfig.to_peft_dict`)
  adapter_model.safetensors  "base_model.model.<module path>.lora_A.weight" [r, in] and
                             "base_model.model.<module path>.lora_B.weight" [out, r]
The "base_model.model." prefix is where PEFT's wrappers (PeftModel -> LoraModel) put the
Hugging Face model; PEFT strips the adapter name ("default") from keys when it saves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora, lora_modules, lora_state_dict
from utils.atomic_io import atomic_write_bytes, atomic_write_json

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def save_adapter(
    model: nn.Module,
    directory: str | os.PathLike,
    config: LoraConfig,
    base_model_name_or_path: str,
    revision: str | None = None,
) -> Path:
    """Write the model's LoRA weights (fp32, on CPU) and config to `directory`; returns it.
    revision: the base's Hub commit, when the base is a Hub id.

    Each file is written atomically. On XLA, call `torch_xla.sync()` first so the weights
    are the ones after the last step; the copy to CPU below waits for them.
    """
    tensors = {name: tensor.to("cpu").contiguous() for name, tensor in lora_state_dict(model).items()}
    if not tensors:
        raise ValueError("save_adapter: the model has no LoRA layers; nothing to save")
    return write_adapter(directory, tensors, config, base_model_name_or_path, revision)


def write_adapter(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], config: LoraConfig,
                  base_model_name_or_path: str, revision: str | None = None) -> Path:
    """Write `tensors` ({"<module path>.lora_A.weight": [r, in], ...lora_B...: [out, r]}, on the
    CPU) and `config` in PEFT's layout; returns the directory. NaN/inf weights are refused."""
    bad = [name for name, tensor in tensors.items() if not bool(torch.isfinite(tensor).all())]
    if bad:
        raise ValueError(f"adapter: refusing to write NaN/inf weights ({len(bad)} tensors, first {bad[0]!r}); "
                         "the previous adapter on disk, if any, is left as it was")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Weights first, config last: a directory with a config always has its weights.
    payload = {PEFT_PREFIX + name: tensor.contiguous() for name, tensor in tensors.items()}
    atomic_write_bytes(directory / WEIGHTS_NAME, save(payload, metadata={"format": "pt"}))
    atomic_write_json(directory / CONFIG_NAME, config.to_peft_dict(base_model_name_or_path, revision))
    return directory


def read_adapter_config(directory: str | os.PathLike) -> tuple[LoraConfig, dict]:
    """(LoraConfig, raw JSON dict) of the adapter in `directory`, with clear errors."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no adapter config here; is {directory} an adapter directory?")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return LoraConfig.from_peft_dict(raw, source=str(path)), raw


def read_adapter_weights(directory: str | os.PathLike) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path: (A [r, in], B [out, r])} of the adapter in `directory`, read without a model;
    a module with only one of its two matrices, or with matrices of other ranks, is an error."""
    weights_path = Path(directory) / WEIGHTS_NAME
    tensors = read_weights_file(weights_path)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for side in ("A", "B"):
            if name.endswith(f".lora_{side}.weight"):
                modules.setdefault(name.removesuffix(f".lora_{side}.weight"), {})[side] = tensor
                break
        else:
            raise ValueError(f"{weights_path}: {key!r} is not a LoRA matrix (lora_A.weight / lora_B.weight)")
    pairs = {}
    for name, sides in modules.items():
        if set(sides) != {"A", "B"} or sides["A"].shape[0] != sides["B"].shape[1]:
            shapes = {side: tuple(t.shape) for side, t in sides.items()}
            raise ValueError(f"{weights_path}: module {name!r} has no matching lora_A [r, in] and lora_B [out, r] "
                             f"(found {shapes})")
        pairs[name] = (sides["A"], sides["B"])
    return pairs


def read_weights_file(weights_path: Path) -> dict[str, torch.Tensor]:
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path}: adapter weights are missing")
    try:
        return load_file(weights_path)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{weights_path}: unreadable safetensors file ({err})") from None


def load_adapter(model: nn.Module, directory: str | os.PathLike) -> LoraConfig:
    """Load a PEFT-layout adapter into `model`; returns its config.

    A model without LoRA layers is injected first with the adapter's own config. Every key
    and shape is checked: a missing, unexpected or misshapen tensor is an error that lists
    them, and nothing is loaded unless everything fits.
    """
    config, _ = read_adapter_config(directory)
    modules = list(lora_modules(model))
    if not modules:
        inject_lora(model, config)
        modules = list(lora_modules(model))
    merged = [name for name, m in modules if m.merged]
    if merged:
        raise ValueError(f"load_adapter: {len(merged)} LoRA layers are merged (e.g. {merged[0]!r}); unmerge first")
    mismatched = [name for name, m in modules if m.r != config.r or m.scaling != config.scaling]
    if mismatched:
        m = dict(modules)[mismatched[0]]
        raise ValueError(
            f"{Path(directory) / CONFIG_NAME}: r={config.r}, scaling={config.scaling:g} but the model's LoRA "
            f"layer {mismatched[0]!r} has r={m.r}, scaling={m.scaling:g}; load into a fresh base model"
        )

    weights_path = Path(directory) / WEIGHTS_NAME
    tensors = read_weights_file(weights_path)

    expected = {PEFT_PREFIX + name: t for name, t in lora_state_dict(model).items()}
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    misshapen = sorted(
        f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected.keys() & tensors.keys()
        if tensors[k].shape != expected[k].shape
    )
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)):
        if items:
            shown = "; ".join(items[:5]) + (f"; ... ({len(items) - 5} more)" if len(items) > 5 else "")
            problems.append(f"{len(items)} {label}: {shown}")
    if problems:
        raise ValueError(
            f"{weights_path} does not fit this model ({type(model).__name__}): " + " | ".join(problems)
        )

    with torch.no_grad():
        for key, param in expected.items():
            param.copy_(tensors[key].to(dtype=param.dtype))
    return config
