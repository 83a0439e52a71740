"""The native runtime's device (runtime.device): a CPU, a CUDA GPU, or TorchTPU's `tpu` device.

TorchTPU (the `torch-tpu` package, imported as `torch_tpu`) is PyTorch's own TPU backend: it
registers the `tpu` device and needs torch >= 2.11 and <= 2.15 on Python >= 3.11. It is imported
only when runtime.device=tpu asks for it, so nothing else on the native path depends on it.
What this module knows of it comes from its package (torch_tpu 0.2.0): no TPU has run it here.
"""

from __future__ import annotations

import torch

from finetuning_pipeline.errors import ConfigError

TORCH_TPU_INSTALL = "pip install torch-tpu (with torch >= 2.11 and <= 2.15, Python >= 3.11; no torch_xla)"
# Each device's torch.distributed backend, and the torch.compile backend its layers compile with.
# TorchTPU's (torch_tpu 0.2.0, read from its package: _loader.py registers the process group
# backend "tpu_dist", _internal/compile registers the dynamo backend "tpu") are not run here.
PROCESS_GROUP_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "tpu": "tpu_dist"}
COMPILE_BACKENDS = {"cpu": "inductor", "cuda": "inductor", "tpu": "tpu"}


def auto_device_type() -> str:
    """runtime.device=auto: a CUDA GPU where PyTorch sees one (no device is started), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def native_device(setting: str, key: str = "runtime.device") -> torch.device:
    """runtime.device (or a command's `key`, evaluate's and generate's --device: the same words) ->
    the torch device, or a ConfigError naming what is missing."""
    if setting == "auto":
        return torch.device(auto_device_type())
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{said(key, 'cuda')}: PyTorch {torch.__version__} sees no CUDA GPU here "
                              f"({'a CPU-only build' if torch.version.cuda is None else 'no device or driver'}); "
                              f"use {said(key, 'cpu')} or auto")
        return torch.device("cuda", torch.cuda.current_device())
    return tpu_device(key)


def said(key: str, value: str) -> str:
    """runtime.device=cuda, or --device cuda."""
    return f"{key} {value}" if key.startswith("--") else f"{key}={value}"


def import_torch_tpu(key: str = "runtime.device"):
    """TorchTPU's `torch.tpu` module (importing torch_tpu registers it and the "tpu" device), or a
    ConfigError naming the install."""
    try:
        import torch_tpu  # noqa: F401
    except ImportError:
        raise ConfigError(f"{said(key, 'tpu')}: TorchTPU is not installed in this environment (torch "
                          f"{torch.__version__}); {TORCH_TPU_INSTALL}, or use runtime.backend=xla on a TPU") from None
    return getattr(torch, "tpu", None)


def tpu_device(key: str = "runtime.device") -> torch.device:
    tpu = import_torch_tpu(key)
    if tpu is None or not tpu.is_available():
        raise ConfigError(f"{said(key, 'tpu')}: TorchTPU is installed but finds no TPU on this machine; run on a TPU "
                          f"VM, or use {said(key, 'cpu')}")
    return torch.device("tpu", tpu.current_device())


def compiles_layers(setting: str, device: torch.device, dtype: str = "bfloat16") -> bool:
    """runtime.compile: auto compiles each decoder layer on an accelerator, not on a CPU (inductor's
    compile there costs more than a short run saves), nor for a float64 proof (validate.py)."""
    if setting == "auto":
        return device.type != "cpu" and dtype != "float64"
    return setting == "layers"
