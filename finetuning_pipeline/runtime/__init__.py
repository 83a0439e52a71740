"""The seam between the trainer and the runtime that executes its steps: torch_xla (`xla`,
the default and the TPU's path) or native PyTorch (`native`: a CPU, a GPU, TorchTPU).

The phase loop, the data, the LoRA, curricula, adapters side by side, the quantized base,
checkpoints and resume, metrics and export are shared. What differs is one object a phase is
given (`runtime`), made by `start_runtime` with the replica's Parallel and device:

    runtime.name                       "xla" or "native" (the phase's summary records it)
    runtime.stepper(...)               the optimizer step (train.stepper.Stepper's seeds, LR table,
                                       update) and how it executes: captured and replayed on XLA,
                                       eagerly or with each decoder layer compiled natively
    runtime.device_batches(data, dev)  the phase's micro-batches on the device
    runtime.step_boundary()            the end of a step's work: torch_xla.sync() dispatches its graph;
                                       natively the step's kernels are already queued, nothing to do
    runtime.after_step(fn, args)       fn(*args) once the step's results exist (XLA: a step closure)
    runtime.wait()                     until the device has finished what was queued
    runtime.counters()                 compiles, compile seconds (XLA: and host syncs) so far (CompileGuard)
    runtime.counting_host_syncs()      native: a context counting the host syncs of what runs in it, which
                                       CompileGuard puts around one step (counts_host_syncs_each_step:
                                       False); XLA's counters count every step's (True)
    runtime.peak_memory_bytes(dev)     the device's peak memory, or None where it reports none
    runtime.scans                      whether the decoder layers may be scanned (torch_xla's scan);
                                       runtime.layers_note() says how they run where they are not

xla.py holds the XLA half (its launcher, parallel modes and collectives are distributed/'s);
native.py, runtime/native/device.py and runtime/native/step.py the native half, which imports no torch_xla.
"""

from __future__ import annotations

import os

from finetuning_pipeline.run_config import RunConfig, RuntimeConfig
from finetuning_pipeline.runtime.xla.device import choose_device


def prepare_process(runtime: RuntimeConfig, *, first_process: bool) -> None:
    """Before anything imports transformers. XLA: the PJRT device chosen and said once (by the
    first process: torchrun's others inherit it). Native: USE_TORCH_XLA=0, which transformers
    and accelerate read, so that they leave an installed torch_xla unimported (accelerate
    imports it at its own import otherwise, and it then takes a device), and the profiler that
    counts host syncs started once on this main thread (runtime/native/host_syncs.py)."""
    if runtime.backend == "native":
        os.environ.setdefault("USE_TORCH_XLA", "0")
        from finetuning_pipeline.runtime.native.host_syncs import start_profiler_on_this_thread

        start_profiler_on_this_thread()  # (on the main thread: the replica's runs on another)
    elif first_process:
        choose_device()


def start_runtime(config: RunConfig):
    """(runtime, Parallel, device) of this replica, for config.runtime.backend."""
    if config.runtime.backend == "native":
        from finetuning_pipeline.runtime.native.runtime import start_native

        return start_native(config)
    from finetuning_pipeline.runtime.xla.runtime import start_xla

    return start_xla(config.parallel)
