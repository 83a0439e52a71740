"""The XLA runtime's half of the seam (runtime/__init__.py): torch_xla over PJRT. Its steps are
captured once and replayed (runtime/xla/step_capture.py), its step boundary is `torch_xla.sync()`,
and its replicas are launched and summed by distributed/."""

from __future__ import annotations

from finetuning_pipeline.distributed.parallel import start
from finetuning_pipeline.run_config import ParallelConfig
from finetuning_pipeline.train.stepper import Stepper
from finetuning_pipeline.runtime.xla.counters import XlaCounters, read_counters
from finetuning_pipeline.runtime.xla.device import peak_memory_bytes


class XlaRuntime:
    name = "xla"
    scans = True
    counts_host_syncs_each_step = True  # torch_xla's counter, read around every step

    def stepper(self, *args, **kwargs) -> Stepper:
        return Stepper(*args, **kwargs)

    def device_batches(self, data, device):
        return data.device_batches(device)  # torch_xla's ParallelLoader, prefetching on its thread

    def step_boundary(self) -> None:
        import torch_xla

        torch_xla.sync()

    def after_step(self, fn, args: tuple) -> None:
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(fn, args=args)

    def wait(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    def counters(self) -> XlaCounters:
        return read_counters()

    def peak_memory_bytes(self, device) -> int | None:
        return peak_memory_bytes(device)


def start_xla(parallel: ParallelConfig):
    """(XlaRuntime, Parallel, device): PJRT initialised for parallel.mode (distributed/parallel.py)."""
    replicas, device = start(parallel.mode, (parallel.mesh.data, parallel.mesh.fsdp), parallel.host_timeout_s)
    return XlaRuntime(), replicas, device
