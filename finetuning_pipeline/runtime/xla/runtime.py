"""The XLA runtime (runtime/protocol.py): torch_xla over PJRT, the TPU's path and the default.

Its steps are captured once and replayed (step_execution.py), its step boundary is
`torch_xla.sync()`, its batches arrive through torch_xla's ParallelLoader, its decoder layers may
run as one XLA loop (scan_choice.py) and its attention as Pallas kernels (kernel_attention.py),
and its replicas are started by the TPU host's launcher or torchrun (launch.py, replicas.py).
"""

from __future__ import annotations

import contextlib
import os

import torch

from finetuning_pipeline.distributed.collectives import torchrun_world
from finetuning_pipeline.distributed.parallel import Parallel
from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.model.attention_choice import TargetMachine
from finetuning_pipeline.run_config import RunConfig
from finetuning_pipeline.runtime.protocol import Parallelized
from finetuning_pipeline.runtime.xla.compile_cache import use_compile_cache
from finetuning_pipeline.runtime.xla.counters import XlaCounters, donations_of_last_graphs, read_counters
from finetuning_pipeline.runtime.xla.device import choose_device, device_kind, peak_memory_bytes
from finetuning_pipeline.runtime.xla.kernel_attention import attention_here, enable_kernel_attention, this_machine
from finetuning_pipeline.runtime.xla.launch import (
    HIDDEN_TORCH_XLA,
    apply_single_chip,
    launch_replicas,
    resolve_launcher,
)
from finetuning_pipeline.runtime.xla.layer_scan import ScannedLayers
from finetuning_pipeline.runtime.xla.replicas import start_replica
from finetuning_pipeline.runtime.xla.scan_choice import scan_layers
from finetuning_pipeline.runtime.xla.step_execution import XlaStepExecution


class XlaRuntime:
    name = "xla"
    counts_host_syncs_each_step = True  # torch_xla's counter, read around every step

    def parallelize(self, model: torch.nn.Module, config: RunConfig, parallel: Parallel, device,
                    seq_len: int) -> Parallelized:
        """The decoder layers scanned where train.scan_layers allows (on the host, before they move:
        the stacking then costs host memory, one weight's stack at a time), the model placed (and
        under fsdp sharded as it arrives: spmd.py), and the attention kernel the machine runs."""
        spmd = parallel.shards_batch_in_process
        layers = scan_layers(model, config.train.scan_layers,
                             activation_checkpointing=config.model.activation_checkpointing, spmd=spmd)
        sharded = parallel.place_model(model, device)
        attention, why = attention_here(config.model.attention, model.config, spmd_mesh=spmd, seq_len=seq_len,
                                        dp_processes=1 if spmd else parallel.world)
        if attention != "dense":
            enable_kernel_attention(model, attention, getattr(parallel, "mesh", None))
        return Parallelized(sharded, scanned_layers=any(isinstance(m, ScannedLayers) for m in model.modules()),
                            description=f"{why}; {layers}")

    def step_execution(self, model, optimizer, **settings) -> XlaStepExecution:
        return XlaStepExecution(model, optimizer, **settings)

    def device_batches(self, data, device):
        """The phase's batches on the device, prefetched by torch_xla's loader thread. That thread
        drops an exception of the reader (a shard that became unreadable: EIO, a vanished
        network disk) and simply ends the iteration, which the loop would take for a
        StopIteration traceback; the reader's error is kept and raised here instead. Closing
        this generator stops and joins the loader's threads (they hold the phase's data)."""
        import torch_xla.distributed.parallel_loader as pl

        failure: list[BaseException] = []

        def read():  # runs on the loader's thread
            try:
                yield from data.batches()
            except Exception as err:
                failure.append(err)

        # We mark every step ourselves; by default the loader would also sync at each next().
        loader = pl.ParallelLoader(read(), [device], batches_per_execution=1 << 30,
                                   input_sharding=data.parallel.input_sharding())
        try:
            yield from loader.per_device_loader(device)
        finally:
            loader.close()
        raise failure[0] if failure else RuntimeError("the data loader stopped without an error (a bug)")

    def to_device(self, batch: dict, device, input_sharding=None) -> dict:
        import torch_xla.core.xla_model as xm

        return xm.send_cpu_data_to_device(batch, device, input_sharding)

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

    def counting_host_syncs(self):
        return contextlib.nullcontext()  # (never asked: its counter counts every step)

    def first_step_donations(self, compiles: int) -> int | None:
        # The step's graph is compiled at its first run; the largest donation of the graphs
        # compiled then is its own (replica threads of this process compile the same graph).
        return max(donations_of_last_graphs(compiles), default=0)

    def recompile_message(self, phase: int, step: int, compiles: int) -> str:
        return (f"phase {phase} step {step}: {compiles} new XLA graph(s) compiled after warm-up (a changing shape "
                "or Python scalar); rerun with PT_XLA_DEBUG_LEVEL=2 to see the cause")

    def peak_memory_bytes(self, device) -> int | None:
        return peak_memory_bytes(device)


class XlaBackend:
    """The XLA runtime before a replica exists (runtime/protocol.py's Backend)."""

    name = "xla"
    device_environment = ("PJRT_DEVICE", "CPU_NUM_DEVICES", "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS",
                          "TPU_CHIPS_PER_PROCESS_BOUNDS")
    plan_note = None  # preflight's plan is this runtime's
    self_check = "device_check"  # checks/device_check.py: kernels, captured step, scan, donation, HBM, MFU
    checks_a_pod = True  # PJRT spans the slice: each of the check's runs is a run of every host

    def plans_gpu(self, config: RunConfig) -> bool:
        return False

    def prepare_process(self, config: RunConfig, first_process: bool) -> None:
        """The PJRT device chosen and said once (by the first process: torchrun's others inherit it).
        A process that will start the TPU launcher's workers trains nothing itself: its
        transformers and accelerate are told to leave torch_xla unimported (launch.py,
        HIDDEN_TORCH_XLA), and its workers are told otherwise again."""
        if first_process:
            choose_device()
        if self.launcher(config) == "tpu":
            HIDDEN_TORCH_XLA.hide()

    def target_machine(self, config: RunConfig) -> TargetMachine:
        return this_machine(config.model.attention)

    def device_name(self, config: RunConfig) -> str:
        return f"PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'CPU')}"  # (chosen by prepare_process)

    def before_run(self, config: RunConfig, command: list[str], script: str) -> None:
        return None  # (its launcher starts in launch, once the run is planned)

    def launch(self, config: RunConfig, replica, args: tuple) -> None:
        """The TPU host's launcher (a process per chip, a replica per device on a worker thread), or
        this process as the replica: one of torchrun's, or the host's one SPMD process (launch.py)."""
        kind = device_kind()
        if config.model.dtype == "float64" and kind == "TPU":
            raise ConfigError("model.dtype=float64 is for the tests' equality proofs on a CPU (a TPU does not "
                              "compute in float64); set model.dtype=bfloat16")
        if torchrun_world() > 1 and kind != "CPU":
            raise ConfigError("torchrun starts replicas on a CPU only (PJRT_DEVICE=CPU); on a TPU run plain python: "
                              "it starts one process per chip")
        launcher = self.launcher(config)
        if config.parallel.single_chip:
            apply_single_chip(kind)
        if launcher == "tpu":
            HIDDEN_TORCH_XLA.show()  # (the workers train: torch_xla is theirs)
            launch_replicas(replica, args, compile_cache=config.xla.compile_cache_dir, mode=config.parallel.mode)
        else:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            use_compile_cache(config.xla.compile_cache_dir, config.parallel.mode, local)
            replica(*args)

    def launcher(self, config: RunConfig) -> str:
        """"tpu" (this process starts the TPU host's workers) or "process" (it is the replica)."""
        return resolve_launcher(config.parallel.launcher, config.parallel.mode, device_kind(), torchrun_world())

    def start(self, config: RunConfig):
        """(XlaRuntime, Parallel, device): PJRT initialised for parallel.mode (replicas.py)."""
        p = config.parallel
        parallel, device = start_replica(p.mode, (p.mesh.data, p.mesh.fsdp), p.host_timeout_s)
        return XlaRuntime(), parallel, device
