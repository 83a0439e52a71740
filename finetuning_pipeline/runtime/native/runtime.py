"""The native runtime (runtime/protocol.py): plain PyTorch on one device in this process, or, under
torchrun, one process of several (parallel.mode=dp: ddp.py; fsdp: fsdp.py).
Nothing here imports torch_xla: a GPU machine or a TorchTPU VM has none.

The step is step.py's, each decoder layer compiled by torch.compile where runtime.compile says;
the data arrives by a plain copy per micro-batch (non-blocking from pinned memory on an
accelerator); compiles are dynamo's own counters; host syncs are counted on one step by
PyTorch's profiler (host_syncs.py: PyTorch keeps no counter of them).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from finetuning_pipeline.distributed.collectives import Collectives, launch_rank, replica_group, torchrun_world
from finetuning_pipeline.distributed.parallel import Parallel
from finetuning_pipeline.model.attention_choice import TargetMachine, choose_attention
from finetuning_pipeline.run.stop_signal import on_a_thread_leaving_signals_here
from finetuning_pipeline.run_config import RunConfig
from finetuning_pipeline.runtime.native.device import (
    COMPILE_BACKENDS,
    PROCESS_GROUP_BACKENDS,
    auto_device_type,
    compiles_layers,
    native_device,
)
from finetuning_pipeline.runtime.native.device_sum import TorchAllReduce
from finetuning_pipeline.runtime.native.fsdp import NativeFsdp, device_mesh
from finetuning_pipeline.runtime.native.host_syncs import HostSyncCount, start_profiler_on_this_thread
from finetuning_pipeline.runtime.native.step import NativeStepExecution, compile_decoder_layers
from finetuning_pipeline.runtime.native.tpu_launch import run_processes_on_tpu
from finetuning_pipeline.runtime.protocol import Parallelized


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
    counts_host_syncs_each_step = False  # the profiler counts one step (CompileGuard picks it)

    def __init__(self, device: torch.device, compile_layers: bool) -> None:
        self.device, self.compile_layers = device, compile_layers

    def layers_note(self) -> str:
        how = ("each compiled by torch.compile (runtime.compile)" if self.compile_layers
               else "eagerly (runtime.compile=eager; auto compiles them on an accelerator only)")
        return f"native runtime on {self.device}: decoder layers run one by one, {how}"

    def parallelize(self, model: torch.nn.Module, config: RunConfig, parallel: Parallel, device,
                    seq_len: int) -> Parallelized:
        """The model placed (under fsdp sharded layer by layer: fsdp.py), then each decoder layer
        compiled where runtime.compile says. Attention is the model's own (the Pallas kernels are
        torch_xla's)."""
        sharded = parallel.place_model(model, device)
        if self.compile_layers:
            compile_decoder_layers(model, COMPILE_BACKENDS[device.type])
        _, why = choose_attention(config.model.attention, model.config, tpu=None, spmd_mesh=False, seq_len=seq_len)
        notes = [why, self.layers_note()]
        if parallel.mode == "fsdp" and parallel.world == 1:
            notes.append("parallel.mode=fsdp in one process shards nothing: FSDP2 shards over torchrun's processes "
                         "(torchrun --nproc-per-node N); this run holds the whole base, as dp's one process does")
        return Parallelized(sharded, compiled_layers=self.compile_layers, description="; ".join(notes))

    def step_execution(self, model, optimizer, **settings) -> NativeStepExecution:
        return NativeStepExecution(model, optimizer, **settings)

    def to_device(self, batch: dict, device, input_sharding=None) -> dict:
        return {name: tensor.to(device) for name, tensor in batch.items()}

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

    def first_step_donations(self, compiles: int) -> int | None:
        return None  # (PyTorch donates no buffers: it frees what a step drops)

    def recompile_message(self, phase: int, step: int, compiles: int) -> str:
        return (f"phase {phase} step {step}: {compiles} new graph(s) compiled after warm-up (a changing shape or "
                "Python scalar); rerun with TORCH_LOGS=recompiles to see the cause")

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


class NativeBackend:
    """The native runtime before a replica exists (runtime/protocol.py's Backend)."""

    name = "native"
    device_environment = ("CUDA_VISIBLE_DEVICES",)
    plan_note = ("runtime: native on TorchTPU (runtime.device=tpu): the plan below is the XLA runtime's on a TPU "
                 "(its compile and kernel figures are torch_xla's; TorchTPU's are unmeasured)")
    self_check = "native_check"  # checks/native_check.py: TorchTPU's device, compiled layers, precision
    checks_a_pod = False  # the check runs one process on one host

    def plans_gpu(self, config: RunConfig) -> bool:
        return config.runtime.device != "tpu"  # (TorchTPU's device: tpu.type's TPU)

    def prepare_process(self, config: RunConfig, first_process: bool) -> None:
        """USE_TORCH_XLA=0, which transformers and accelerate read, so that they leave an installed
        torch_xla unimported (accelerate imports it at its own import otherwise, and it then takes a
        device), and the profiler that counts host syncs started once on this main thread
        (host_syncs.py; the replica runs on another)."""
        os.environ.setdefault("USE_TORCH_XLA", "0")
        start_profiler_on_this_thread()

    def target_machine(self, config: RunConfig) -> TargetMachine:
        return TargetMachine()  # (the Pallas kernels are torch_xla's)

    def device_name(self, config: RunConfig) -> str:
        """runtime.device as it resolves, without starting a device (a CUDA context in each of
        torchrun's processes would sit on GPU 0)."""
        setting = config.runtime.device
        if setting == "auto":
            return f"{auto_device_type()} (runtime.device=auto)"
        return setting

    def before_run(self, config: RunConfig, command: list[str], script: str) -> int | None:
        """On a TPU host, TorchTPU's way to a process per chip: torchrun's agent over this command,
        before anything is written (tpu_launch.py); its exit status, or None on one chip."""
        if config.runtime.device == "tpu" and torchrun_world() == 1:
            return run_processes_on_tpu(script, command)
        return None

    def launch(self, config: RunConfig, replica, args: tuple) -> None:
        """The one replica of this process, on a thread that leaves the stop signals to this main
        thread (gloo's, autograd's and the profiler's threads then leave them too)."""
        on_a_thread_leaving_signals_here(replica, *args)

    def start(self, config: RunConfig):
        return start_native(config)


def start_native(config: RunConfig):
    """(NativeRuntime, Parallel, device): one replica in this process, on runtime.device; under
    torchrun one of its processes, in torch.distributed's default group: parallel.mode=dp (DDP:
    ddp.py) or fsdp (FSDP2 over parallel.mesh: fsdp.py)."""
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
    return Collectives(rank, world, group, stores, device_sum=TorchAllReduce())
