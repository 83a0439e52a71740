"""A replica of the XLA runtime started: PJRT initialised for parallel.mode, and how its device
sums go (collectives.py's kinds): one process per TPU chip under dp (an XLA all-reduce inside the
step's graph), processes started by torchrun on a CPU (through gloo on the host: XLA:CPU has no
cross-process collectives, pytorch/xla#5342), the TPU host's launcher's threads on a CPU
(launch.py: also through the host), or one SPMD program per host under fsdp (spmd.py: the
partitioner inserts the reductions).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from finetuning_pipeline.distributed.collectives import Collectives, replica_group, torchrun_world
from finetuning_pipeline.distributed.parallel import DATA_AXIS, FSDP_AXIS, Parallel, mesh_shape
from finetuning_pipeline.runtime.xla.device import choose_device, device_kind, init_xla_device
from finetuning_pipeline.runtime.xla.device_sum import HostRoundTrip, XlaAllReduce
from finetuning_pipeline.runtime.xla.spmd import SpmdParallel


def start_replica(mode: str, mesh: tuple[int, int] = (1, -1),
                  host_timeout_s: float = 1800) -> tuple[Parallel, torch.device]:
    """Initialise the runtime for `mode` on this replica and return (Parallel, device).
    mesh: (data, fsdp) axis sizes under fsdp, -1 for "the remaining chips".
    Under fsdp this must run before any XLA tensor exists (SPMD is a process-wide switch); so
    must use_compile_cache, once per process, before (launch.py)."""
    import torch_xla.distributed.xla_backend  # noqa: F401 - registers the xla:// rendezvous
    choose_device()
    import torch_xla.runtime as xr

    if mode == "fsdp":
        xr.use_spmd()

    device = init_xla_device()  # before any backward in this process
    if torchrun_world() > 1:
        # Processes started by torchrun on a CPU: each is its own XLA world of one; they talk
        # through gloo on the host (torchrun's MASTER_ADDR/PORT), device sums included.
        rank, world = int(os.environ["RANK"]), torchrun_world()
        collectives = Collectives(rank, world, *replica_group("env://", rank, world, host_timeout_s),
                                  device_sum=HostRoundTrip())
    elif mode == "dp":
        # One replica per device: the launcher's threads (launch.py), one or two per process.
        # XLA:CPU cannot all-reduce across threads, so there the device sums go through gloo.
        rank, world = xr.global_ordinal(), xr.world_size()
        group = replica_group("xla://", rank, world, host_timeout_s) if world > 1 else (None, None)
        collectives = Collectives(rank, world, *group,
                                  device_sum=XlaAllReduce() if device_kind() != "CPU" else HostRoundTrip())
    else:
        rank, world = xr.process_index(), xr.process_count()
        group = replica_group("xla://", rank, world, host_timeout_s) if world > 1 else (None, None)
        collectives = Collectives(rank, world, *group)  # (the partitioner sums over the mesh)
    if mode == "dp":
        return Parallel("dp", collectives), device
    import torch_xla.distributed.spmd as xs

    # The mesh spans every chip of the SPMD program: all hosts' on a pod, this process's own
    # under torchrun (where each process is a separate XLA world).
    chips = xr.global_runtime_device_count()
    data, fsdp = mesh_shape(chips, *mesh)
    spmd_mesh = xs.Mesh(np.arange(chips), (data, fsdp), (DATA_AXIS, FSDP_AXIS))
    return SpmdParallel("fsdp", collectives, chips_per_process=xr.addressable_runtime_device_count(),
                        mesh=spmd_mesh), device
