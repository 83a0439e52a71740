"""Save and load adapters in PEFT's on-disk layout, so PEFT and vLLM read them unchanged.

Layout of an adapter directory:
  adapter_config.json        PEFT's LoraConfig fields (`LoraConfig.to_peft_dict`)
  adapter_model.safetensors  "base_model.model.<module path>.lora_A.weight" [r, in] and
                             "base_model.model.<module path>.lora_B.weight" [out, r]; a module
                             trained in full (modules_to_save): "base_model.model.<module path>.weight"
                             (tied embeddings: under both modules' names, as PEFT writes them)
The "base_model.model." prefix is where PEFT's wrappers (PeftModel -> LoraModel) put the
Hugging Face model; PEFT strips the adapter name ("default") from keys when it saves.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from lora_logic.adapters import adapter_names, lora_modules, lora_state_dict
from lora_logic.config import DEFAULT_ADAPTER, LoraConfig, adapter_set
from lora_logic.inject import inject_lora
from lora_logic.modules_to_save import ties_embeddings
from utils.atomic_io import atomic_write_bytes, atomic_write_json

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def save_adapters(
    model: nn.Module,
    directories: str | os.PathLike | Mapping[str, str | os.PathLike],
    configs: LoraConfig | Mapping[str, LoraConfig],
    base_model_name_or_path: str,
    revision: str | None = None,
) -> dict[str, Path]:
    """Write each adapter of `configs` ({name: config}; a LoraConfig alone: the model's only
    adapter) as a PEFT adapter of its own in its directory of `directories` ({name: directory};
    one directory for a set of one): fp32 weights on the CPU and the config. Returns the
    directories. revision: the base's Hub commit, when the base is a Hub id.

    Each file is written atomically. On XLA, call `torch_xla.sync()` first so the weights
    are the ones after the last step; the copy to CPU below waits for them.
    """
    configs = adapter_set(configs)
    directories = _per_adapter(directories, list(configs))
    written = {}
    tied = ties_embeddings(model)
    for name, config in configs.items():
        tensors, copied = {}, set()
        for key, tensor in lora_state_dict(model, name).items():
            tensor = tensor.to("cpu").contiguous()
            # (safetensors refuses two names of one memory: a tied weight is written under both, a copy each)
            tensors[key] = tensor.clone() if tensor.data_ptr() in copied else tensor
            copied.add(tensor.data_ptr())
        if not tensors:
            raise ValueError(f"save_adapters: the model has no LoRA weights of adapter {name!r}; nothing to save")
        written[name] = write_adapter(directories[name], tensors, config, base_model_name_or_path, revision,
                                      tied_embeddings=tied and bool(config.modules_to_save))
    return written


def _per_adapter(directories, names: list[str]) -> dict[str, Path]:
    """{adapter: its directory} from a mapping, or from one directory for a set of one adapter."""
    if not isinstance(directories, Mapping):
        if len(names) != 1:
            raise ValueError(f"{len(names)} adapters ({', '.join(names)}) need a directory each, got one")
        return {names[0]: Path(directories)}
    if list(directories) != names:
        raise ValueError(f"directories for adapters {list(directories)}, but the adapters are {names}")
    return {name: Path(d) for name, d in directories.items()}


def write_adapter(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], config: LoraConfig,
                  base_model_name_or_path: str, revision: str | None = None, tied_embeddings: bool = False) -> Path:
    """Write `tensors` ({"<module path>.lora_A.weight": [r, in], ...lora_B...: [out, r]}, on the
    CPU) and `config` in PEFT's layout; returns the directory. NaN/inf weights are refused.
    tied_embeddings: see LoraConfig.to_peft_dict."""
    bad = [name for name, tensor in tensors.items() if not bool(torch.isfinite(tensor).all())]
    if bad:
        raise ValueError(f"adapter: refusing to write NaN/inf weights ({len(bad)} tensors, first {bad[0]!r}); "
                         "the previous adapter on disk, if any, is left as it was")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Weights first, config last: a directory with a config always has its weights.
    payload = {PEFT_PREFIX + name: tensor.contiguous() for name, tensor in tensors.items()}
    atomic_write_bytes(directory / WEIGHTS_NAME, save(payload, metadata={"format": "pt"}))
    atomic_write_json(directory / CONFIG_NAME, config.to_peft_dict(base_model_name_or_path, revision, tied_embeddings))
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
    if not tensors:
        raise ValueError(f"{weights_path}: holds no tensors, so it is no trained adapter (an interrupted write, or "
                         "a file from elsewhere); export the phase's adapter again")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for side in ("A", "B"):
            if name.endswith(f".lora_{side}.weight"):
                modules.setdefault(name.removesuffix(f".lora_{side}.weight"), {})[side] = tensor
                break
        else:
            raise ValueError(f"{weights_path}: {key!r} is not a LoRA matrix (lora_A.weight / lora_B.weight): the "
                             "adapter holds embeddings trained beside the LoRA (lora.modules_to_save or "
                             "trainable_token_indices), which only a merged model carries; export it merged "
                             "(python -m finetuning_pipeline.export --base ... --adapter ... --out MERGED), and a "
                             "GGUF from that (--format gguf --base MERGED)")
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


def load_adapters(model: nn.Module, directories: str | os.PathLike | Mapping[str, str | os.PathLike]
                  ) -> dict[str, LoraConfig]:
    """Load PEFT-layout adapters into `model`: {adapter: its directory}, or one directory for a
    model's only adapter (DEFAULT_ADAPTER). Returns {adapter: its config}.

    A model without LoRA layers is injected first with the adapters' own configs (several:
    side by side, in the mapping's order). Every key and shape is checked: a missing,
    unexpected or misshapen tensor is an error that lists them, and nothing is loaded unless
    every adapter fits.
    """
    if not isinstance(directories, Mapping):
        directories = {DEFAULT_ADAPTER: directories}
    directories = {name: Path(d) for name, d in directories.items()}
    configs = {name: read_adapter_config(d)[0] for name, d in directories.items()}
    modules = list(lora_modules(model))
    if not modules:
        inject_lora(model, configs)
        modules = list(lora_modules(model))
    names = adapter_names(model)
    if set(names) != set(directories):
        raise ValueError(f"the model's adapters are {names}, the adapters to load {list(directories)}; "
                         "load them into a fresh base model")
    merged = [name for name, m in modules if m.merged]
    if merged:
        raise ValueError(f"load_adapters: {len(merged)} LoRA layers are merged (e.g. {merged[0]!r}); unmerge first")
    loaded = []
    for adapter, directory in directories.items():
        config = configs[adapter]
        mismatched = [(name, m) for name, m in modules
                      if adapter in m.lora_A and (m.r[adapter] != config.r or m.scaling[adapter] != config.scaling)]
        if mismatched:
            name, m = mismatched[0]
            raise ValueError(
                f"{directory / CONFIG_NAME}: r={config.r}, scaling={config.scaling:g} but the model's LoRA layer "
                f"{name!r} has r={m.r[adapter]}, scaling={m.scaling[adapter]:g}; load into a fresh base model"
            )
        weights_path = directory / WEIGHTS_NAME
        tensors = read_weights_file(weights_path)
        expected = {PEFT_PREFIX + name: t for name, t in lora_state_dict(model, adapter).items()}
        problems = _misfits(expected, tensors)
        if problems:
            fits = f"this model ({type(model).__name__})"
            if len(directories) > 1:
                fits = f"adapter {adapter!r} of this model"
            raise ValueError(f"{weights_path} does not fit {fits}: " + " | ".join(problems))
        loaded.append((expected, tensors))
    with torch.no_grad():
        for expected, tensors in loaded:
            for key, param in expected.items():
                param.copy_(tensors[key].to(dtype=param.dtype))
    return configs


def _misfits(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> list[str]:
    """The missing, unexpected and misshapen tensors of a file against the model's, as lines."""
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
    return problems
