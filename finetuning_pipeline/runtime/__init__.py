"""The runtimes that execute the trainer's steps, and the choice between them (runtime.backend).

    xla     torch_xla over PJRT (runtime/xla/): the TPU's path, lazy tensors, the captured step,
            scanned layers, Pallas kernels, the TPU host's launcher; XLA:CPU rehearses it on a CPU.
    native  plain PyTorch (runtime/native/): a CPU, a CUDA GPU, TorchTPU's `tpu` device; each
            decoder layer compiled by torch.compile, DDP and FSDP2 under torchrun.
    auto    (the default) xla where a TPU is attached or PJRT_DEVICE is set, native where a GPU is
            present and no TPU is, xla elsewhere; native wherever torch_xla is not installed, or
            where runtime.device or runtime.compile (the native runtime's settings) is set.

What a runtime is asked is declared in protocol.py (Backend: the process, the checks, the launch;
Runtime: what a replica's phase calls; StepExecution: one optimizer step). The phase loop, the
data, the LoRA, curricula, adapters side by side, the quantized base, checkpoints and resume,
metrics and export are shared and import neither runtime. This module is the one place that
names both: `backend(config)` resolves runtime.backend and hands back that runtime's Backend,
importing only that runtime (a GPU machine or a TorchTPU VM has no torch_xla).
"""

from __future__ import annotations

import importlib.util
import os

from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run_config import RunConfig, RuntimeConfig
from finetuning_pipeline.run_config.validate import validate_runtime
from utils.tpu_detect import tpu_chips

XLA_INSTALL = "pip install -e '.[xla]' (torch 2.9.0 + torch_xla 2.9.0)"


def choose_backend(runtime: RuntimeConfig, environ=None) -> tuple[str, str]:
    """runtime.backend -> ("xla" or "native", why), for this machine and `environ` (os.environ's
    variables by default; main.py passes them as its command started, before it set any)."""
    environ = os.environ if environ is None else environ
    setting = runtime.backend
    if setting == "native":  # (torch_xla is not looked for: a native process never touches it)
        return setting, "runtime.backend=native"
    has_xla = torch_xla_installed()
    if setting == "xla":
        if not has_xla:
            raise ConfigError(f"runtime.backend=xla: torch_xla is not installed in this environment; {XLA_INSTALL}, "
                              "or set runtime.backend=native (or auto)")
        return setting, "runtime.backend=xla"
    if not has_xla:
        unread = (f"; PJRT_DEVICE={environ['PJRT_DEVICE']} is torch_xla's and not read here (runtime.device picks "
                  "the native runtime's device)" if "PJRT_DEVICE" in environ else "")
        return "native", f"runtime.backend=auto and torch_xla is not installed here{unread}"
    named = [f"runtime.{key}={value}" for key, value in (("device", runtime.device), ("compile", runtime.compile))
             if value != "auto"]
    if named:
        return "native", f"runtime.backend=auto and {' '.join(named)} is the native runtime's setting"
    if "PJRT_DEVICE" in environ:
        return "xla", f"runtime.backend=auto and PJRT_DEVICE={environ['PJRT_DEVICE']} is set"
    chips = tpu_chips()
    if chips:
        return "xla", f"runtime.backend=auto and {chips} TPU chips are attached"
    if gpu_present():
        return "native", "runtime.backend=auto, a GPU and no TPU here"
    return "xla", "runtime.backend=auto, no TPU or GPU here: XLA on the CPU, as a TPU would run"


def torch_xla_installed() -> bool:
    """Whether torch_xla can be imported here (looked up, not imported: importing it takes a device)."""
    try:
        return importlib.util.find_spec("torch_xla") is not None
    except ImportError:
        return False


def gpu_present() -> bool:
    """A GPU PyTorch can use (imported only when asked: `main.py --help` imports no torch)."""
    import torch

    return torch.cuda.is_available()


def backend(config: RunConfig, environ=None):
    """The Backend (protocol.py) of config.runtime.backend, resolved in place where it was auto and
    checked for that runtime (validate_runtime); its `reason` says why it was chosen (choose_backend:
    `environ`, os.environ's by default)."""
    name, why = choose_backend(config.runtime, environ)
    if config.runtime.backend != name:
        config.runtime.backend = name
        validate_runtime(config)
    if name == "native":
        from finetuning_pipeline.runtime.native.runtime import NativeBackend

        chosen = NativeBackend()
    else:
        from finetuning_pipeline.runtime.xla.runtime import XlaBackend

        chosen = XlaBackend()
    chosen.reason = why
    return chosen


def choice_line(chosen, config: RunConfig) -> str:
    """The run's first line: which runtime on which device, and why (once its process is prepared)."""
    return f"runtime: {chosen.name} on {chosen.device_name(config)} ({chosen.reason})"
