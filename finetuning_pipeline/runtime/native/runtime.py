"""The native runtime's half of the seam (runtime/__init__.py): plain PyTorch on one device in
this process, or, under torchrun, one process of several (parallel.mode=dp: runtime/native/ddp.py;
fsdp: runtime/native/fsdp.py).
Nothing here imports torch_xla: a GPU machine or a TorchTPU VM has none.

The step is runtime/native/step.py's; the data arrives by a plain copy per micro-batch (non-blocking
from pinned memory on an accelerator); compiles are dynamo's own counters; host syncs are
counted on one step by PyTorch's profiler (runtime/native/host_syncs.py: PyTorch keeps no counter of them).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from finetuning_pipeline.distributed.collectives import Collectives, launch_rank, replica_group, torchrun_world
from finetuning_pipeline.distributed.parallel import Parallel
from finetuning_pipeline.run_config import RunConfig
from finetuning_pipeline.runtime.native.device import PROCESS_GROUP_BACKENDS, compiles_layers, native_device
from finetuning_pipeline.runtime.native.fsdp import NativeFsdp, device_mesh
from finetuning_pipeline.runtime.native.step import NativeStepper
from finetuning_pipeline.runtime.native.host_syncs import HostSyncCount


@dataclass(frozen=True)
class DynamoCounters:
    compiles: int  # graphs dynamo compiled (its unique_graphs)
    compile_seconds: float  # dynamo's own compile time, forward and backward

    def __sub__(self, other: "DynamoCounters") -> "DynamoCounters":
        return DynamoCounters(self.compiles - other.compiles, self.compile_seconds - other.compile_seconds)


def dynamo_counters() -> DynamoCounters:
    from torch._dynamo.utils import compilation_time_metrics, counters

    return DynamoCounters(compiles=int(counters["stats"]["unique_graphs"]),
                          compile_seconds=float(sum(compilation_time_metrics.get("_compile.compile_inner", []))))


class NativeRuntime:
    name = "native"
    scans = False  # the layer scan is torch_xla's; compile_layers compiles one layer's graph instead
    counts_host_syncs_each_step = False  # the profiler counts one step (CompileGuard picks it)

    def __init__(self, device: torch.device, compile_layers: bool) -> None:
        self.device, self.compile_layers = device, compile_layers

    def layers_note(self) -> str:
        how = ("each compiled by torch.compile (runtime.compile)" if self.compile_layers
               else "eagerly (runtime.compile=eager; auto compiles them on an accelerator only)")
        return f"native runtime on {self.device}: decoder layers run one by one, {how}"

    def stepper(self, *args, **kwargs) -> NativeStepper:
        return NativeStepper(*args, compile_layers=self.compile_layers, **kwargs)

    def device_batches(self, data, device):
        accelerator = device.type != "cpu"
        for batch in data.batches():
            yield {name: (tensor.pin_memory() if accelerator else tensor).to(device, non_blocking=accelerator)
                   for name, tensor in batch.items()}

    def step_boundary(self) -> None:
        pass  # the step's kernels are queued as its Python ran

    def after_step(self, fn, args: tuple) -> None:
        fn(*args)  # (its reads wait for this step only, on log steps only)

    def wait(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    def counters(self) -> DynamoCounters:
        return dynamo_counters()

    def counting_host_syncs(self) -> HostSyncCount:
        return HostSyncCount()

    def peak_memory_bytes(self, device) -> int | None:
        """The device's peak allocation through torch.accelerator (CUDA's allocator on a GPU; on a
        TPU whatever TorchTPU's allocator reports there: its 0.2.0 package has no memory function of
        its own in Python), or None where the device keeps none: the summary says n/a, the run goes on."""
        if device.type == "cpu" or not hasattr(torch.accelerator, "max_memory_allocated"):
            return None
        try:
            return int(torch.accelerator.max_memory_allocated(device))
        except (RuntimeError, NotImplementedError):  # an accelerator without a device allocator's statistics
            return None


def start_native(config: RunConfig):
    """(NativeRuntime, Parallel, device): one replica in this process, on runtime.device; under
    torchrun one of its processes, in torch.distributed's default group: parallel.mode=dp (DDP:
    runtime/native/ddp.py) or fsdp (FSDP2 over parallel.mesh: runtime/native/fsdp.py)."""
    runtime, p = config.runtime, config.parallel
    world = torchrun_world()
    if world > 1 and runtime.device in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # a GPU per process
    device = native_device(runtime.device)
    native = NativeRuntime(device, compiles_layers(runtime.compile, device, config.model.dtype))
    if world == 1:
        return native, Parallel(p.mode), device  # (fsdp over one process: nothing to shard)
    collectives = join_processes(device, p.host_timeout_s)
    if p.mode == "dp":
        return native, Parallel("dp", collectives), device
    return native, NativeFsdp("fsdp", collectives, mesh=device_mesh(device, world, p.mesh.data, p.mesh.fsdp)), device


def join_processes(device: torch.device, timeout_s: float) -> Collectives:
    """This process among torchrun's: a gloo group for the replicas' host decisions (collectives.py)
    and torch.distributed's default group on the device's backend (gloo, NCCL, TorchTPU's
    tpu_dist) for its sums, both over the one store torchrun's rendezvous gives."""
    import torch.distributed as dist

    rank, world = launch_rank(), torchrun_world()
    group, stores = replica_group("env://", rank, world, timeout_s)
    dist.init_process_group(PROCESS_GROUP_BACKENDS[device.type], store=dist.PrefixStore("tpu-lora/device", stores[1]),
                            rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return Collectives(rank, world, "torch", group, stores)
