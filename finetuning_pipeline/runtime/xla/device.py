"""The XLA device: PJRT chosen and initialised, torch_xla's settings per device kind, its memory figures."""

from __future__ import annotations

import os
import sys

import torch

from finetuning_pipeline.errors import ConfigError
from utils.tpu_detect import tpu_chips

# The PJRT devices this trainer's XLA runtime runs on: the TPU, and the CPU that rehearses it (a
# GPU takes the native runtime). torch_xla reads the name as written: "cpu" has no plugin.
XLA_DEVICES = ("CPU", "TPU")


def init_xla_device() -> torch.device:
    """Initialise the PJRT runtime and return this process's XLA device.

    Call it before the process runs any `backward()`, CPU ones included: autograd's engine
    sizes its per-device queues on the first backward, and an XLA device registered after
    that fails every XLA backward with "device_ready_queues_ ... INTERNAL ASSERT FAILED"
    (verified on torch 2.9.0 + torch_xla 2.9.0; importing torch_xla alone is not enough).
    Without `PJRT_DEVICE` set, torch_xla guesses and warns; choose_device decides first.
    """
    choose_device()
    for name, value in runtime_env_defaults(os.environ["PJRT_DEVICE"]).items():
        os.environ.setdefault(name, value)  # read by torch_xla at its first step boundary
    import torch_xla

    from finetuning_pipeline.runtime.xla.device_ops import XLA_OPS
    from utils.device_ops import use_ops

    use_ops(XLA_OPS)  # torch_xla's forms of the ops model code leaves to the device
    return torch_xla.device()


def choose_device(say=None) -> str:
    """PJRT_DEVICE as set; unset, TPU on a machine whose PCI bus has TPU chips and CPU elsewhere,
    said once to `say` (default: stderr) and set for this process and its children. (torch_xla
    would guess too, with a warning on every run; defaulting to CPU everywhere would train a
    TPU VM's run on its CPU when a shell lacks the variable.)

    XLA_FLAGS gets that device kind's compiler defaults here too (with_compiler_defaults), for
    this process and its children: XLA reads them once, when its runtime starts, and a TPU
    launcher's worker starts the runtime (compile cache, topology) before its replicas reach
    init_xla_device. A PJRT_DEVICE the XLA runtime does not run on is a ConfigError."""
    if "PJRT_DEVICE" not in os.environ:
        chips = tpu_chips()
        os.environ["PJRT_DEVICE"] = "TPU" if chips else "CPU"
        found = f"{chips} TPU chips found" if chips else "no TPU found on this machine"
        (say or (lambda line: print(line, file=sys.stderr, flush=True)))(
            f"device: {os.environ['PJRT_DEVICE']} (PJRT_DEVICE is not set and {found}; set PJRT_DEVICE=CPU or "
            "PJRT_DEVICE=TPU to choose)")
    if os.environ["PJRT_DEVICE"] not in XLA_DEVICES:  # torch_xla's own word for it is a traceback in a replica
        raise ConfigError(f"PJRT_DEVICE={os.environ['PJRT_DEVICE']!r}: the XLA runtime runs on PJRT_DEVICE=CPU or "
                          "PJRT_DEVICE=TPU (upper case); on a GPU, unset PJRT_DEVICE and train on the native runtime "
                          "(runtime.backend=native)")
    flags = with_compiler_defaults(os.environ.get("XLA_FLAGS", ""), os.environ["PJRT_DEVICE"])
    if flags:
        os.environ["XLA_FLAGS"] = flags
    return os.environ["PJRT_DEVICE"]


def on_the_host_only() -> None:
    """For a command that computes with torch on the host's CPU, not on an XLA device (export,
    generate, evaluate --device cpu): torch_xla, which transformers imports, then takes the CPU
    without a TPU probe or its warning (a value already set is kept)."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")


def runtime_env_defaults(pjrt_device: str) -> dict[str, str]:
    """torch_xla settings we change by default, per device kind (a user's own value wins).

    XLA:CPU: parameter aliasing off. With aliasing, a graph that updates a tensor in place
    (every optimizer step) donates the old buffer, and on XLA:CPU `torch_xla.sync()` then
    returns only once the graph has run, so the host cannot trace step k+1 while step k runs
    (measured: a sync of such a graph took the whole 154 ms execution, 0.2 ms without
    aliasing; the small benchmark's step went from 31 to 25 ms). Without aliasing the update
    writes new buffers: a second copy of the LoRA weights and moments, nothing on a host with
    gigabytes. On accelerators aliasing stays on: it is what keeps that copy out of HBM.
    """
    if pjrt_device.upper() == "CPU":
        return {"XLA_ENABLE_PARAM_ALIASING": "0"}
    return {}


def with_compiler_defaults(xla_flags: str, pjrt_device: str) -> str:
    """XLA_FLAGS with the XLA compiler options we change by default, per device kind; an option
    `xla_flags` already names keeps its value (torch_xla adds its own defaults the same way).

    XLA:CPU, two options, both about the compile time the first step and every restart pay:
    - its tree reduction rewriter off. The pass splits every reduction over more than 32
      elements into a reduce-window and a reduce, and XLA:CPU compiles each of the two as a
      kernel of its own, unfused, at every occurrence: in a decoder, every layer's norms and
      softmaxes, forward and backward, each compiled again. Off, a reduction fuses with what
      computes its input, and the layers' identical fusions are compiled once: the step
      compiles in less time and runs faster. What the pass buys is precision in very long fp32
      sums (a pairwise order instead of lanes of sequential partial sums): a sum of 8M squares
      is off by 4.6e-5 relative without it, 4.8e-9 with it. The longest such sum in a step,
      the gradient norm (40M squares for a 7B model's r 16 on all 7 targets), is summed in
      short levels instead (MaskedAdamW.group_norms).
    - LLVM's loop unrolling off (the backend option XLA:CPU itself sets for its scatter
      kernels). A kernel's loop nest has fixed trip counts, and LLVM unrolls the
      short inner loops in full: the write-back of a [16, 192] LoRA A grows from 5 KB of IR to
      243 KB, 0.36 s of compile. Loops stay vectorized and the step runs as fast; some row sums
      fused with their input come out in another order, of the same precision.
    (docs/benchmarks.md, "The LoRA's own cost and the compile", has the figures.) TPUs compile
    with their own compiler, which these options do not touch.
    """
    defaults = {"xla_disable_hlo_passes": "tree_reduction_rewriter",
                "xla_backend_extra_options": "xla_cpu_disable_loop_unrolling"} if pjrt_device.upper() == "CPU" else {}
    named = {flag.lstrip("-").split("=")[0] for flag in xla_flags.split()}
    return " ".join([xla_flags.strip()] + [f"--{name}={value}" for name, value in defaults.items()
                                           if name not in named]).strip()


def peak_memory_bytes(device) -> int | None:
    """The device's peak memory in use since the process started (torch_xla's memory info; a
    TPU reports it, XLA:CPU does not: None)."""
    import torch_xla.core.xla_model as xm

    try:
        return int(xm.get_memory_info(device)["peak_bytes_used"])
    except (RuntimeError, KeyError):
        return None


def device_kind() -> str:
    """The PJRT device kind this process runs on ("TPU", "CPU", ...)."""
    return os.environ.get("PJRT_DEVICE", "CPU").upper()
