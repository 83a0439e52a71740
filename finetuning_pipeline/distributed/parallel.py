"""How the chips share one run: data parallel processes (`dp`) or one SPMD program (`fsdp`).

dp: one process per chip, each with a full copy of the model and its own slice of every
global batch; gradients, loss sums and eval sums are summed across processes by
`collectives.Collectives` (an XLA all-reduce inside the step's graph on a TPU).

fsdp: one process per host, `xr.use_spmd()`, and a 2-D mesh (`data`, `fsdp`) over every chip
of every host (MaxText's data and fsdp parallelism). The frozen base weights are sharded along
`fsdp` (each chip of a data group holds 1/F of each matrix), so a model bigger than one chip's
HBM fits; the batch is split over both axes, and XLA's SPMD partitioner inserts the
all-gathers of weights and the reductions of gradients. With `fsdp` = 1 nothing is sharded:
pure data parallelism in one process per host, one compile per host instead of one per chip.
The LoRA parameters, their gradients and the optimizer state are replicated: they are small
(under 1% of a 7B model at r 16), a replicated update needs no collective, and a replicated
tensor is whole on every host, so saving gathers the real trained values by construction.

Replicas started by the TPU host's launcher on a CPU (launch.py: CPU_NUM_DEVICES threads in one
process) or by `torchrun` (several processes) use the same code; their device sums go through
the host (see collectives.py), and under fsdp each process's mesh spans its own virtual CPU
devices.

Every process calls the same functions in the same order; `Parallel` holds what differs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from finetuning_pipeline.distributed.collectives import Collectives, replica_group, torchrun_world
from lora_logic.quantized_linear import QuantizedLinear
from finetuning_pipeline.runtime.xla.device import choose_device, device_kind, init_xla_device

DATA_AXIS, FSDP_AXIS = "data", "fsdp"
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)  # the batch is split over both axes


@dataclass
class Parallel:
    """mode: "dp" or "fsdp".
    collectives: this process's rank among the processes that read data (under fsdp: hosts),
        their number, and how they talk.
    chips_per_process: how many chips one process's batches feed (1 under dp).
    mesh: the SPMD mesh under fsdp, None under dp."""

    mode: str
    collectives: Collectives = field(default_factory=Collectives)
    chips_per_process: int = 1
    mesh: object = None

    @property
    def rank(self) -> int:
        return self.collectives.rank

    @property
    def world(self) -> int:
        return self.collectives.world

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def chips(self) -> int:
        return self.world * self.chips_per_process

    def fsdp_size(self) -> int:
        return self.mesh.mesh_shape[1] if self.mesh is not None else 1

    def place_model(self, model: torch.nn.Module, device) -> list[str]:
        """Move the model to the device; under fsdp shard frozen weights (and a quantized base's
        codes and scales) as they arrive, so no chip ever holds a full copy of the model (moving
        it whole would need one). Returns the names of the sharded tensors."""
        if self.mesh is None:
            model.to(device)
            return []
        import torch_xla.distributed.spmd as xs

        sharded = []
        moved: dict[int, torch.nn.Parameter] = {}  # tied weights (embeddings = lm_head) move once
        for module_name, module in model.named_modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) not in moved:
                    on_device = torch.nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
                    spec = shard_spec(param, self.fsdp_size()) if not param.requires_grad else None
                    if spec is not None:
                        sharded.append(f"{module_name}.{name}")
                    xs.mark_sharding(on_device, self.mesh, spec or replicated(param))
                    moved[id(param)] = on_device
                setattr(module, name, moved[id(param)])
            if isinstance(module, QuantizedLinear):  # a quantized weight's codes and scales shard by its rows
                for name in ("codes", "scales"):
                    on_device = getattr(module, name).to(device)
                    spec = shard_spec(on_device, self.fsdp_size())
                    if spec is not None:
                        sharded.append(f"{module_name}.{name}")
                    xs.mark_sharding(on_device, self.mesh, spec or replicated(on_device))
                    setattr(module, name, on_device)
                module.gather_codes = self._whole  # gathered as codes, then dequantized on every chip
        model.to(device)  # the other buffers (rotary tables): small, replicated
        for layer in decoder_layers(model):
            layer.register_forward_hook(self._shard_hidden_states)
        return sharded

    def _shard_hidden_states(self, module, inputs, output):
        # Pin each decoder layer's output to batch sharding (as torch_xla's FSDPv2 does), so
        # the partitioner gathers weights rather than resharding activations by feature.
        import torch_xla.distributed.spmd as xs

        hidden = output[0] if isinstance(output, tuple) else output
        xs.mark_sharding(hidden, self.mesh, (BATCH_AXES,) + (None,) * (hidden.dim() - 1))
        return output

    def _whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """A sharded quantized weight's codes or scales, marked replicated inside the step: the
        partitioner gathers them there and each chip dequantizes the whole weight (an elementwise
        pass). Left to itself, it dequantized each chip's rows and gathered the dequantized weight
        for the matmul, 2 to 4 times the codes' bytes (issue #53.3)."""
        import torch_xla.distributed.spmd as xs

        xs.mark_sharding(tensor, self.mesh, replicated(tensor))
        return tensor

    def replicate(self, tensors: list[torch.Tensor]) -> None:
        """Mark trainer state (LoRA parameters, optimizer state, counters) replicated. Without
        the mark, their shardings after the first step are whatever propagation chose, the
        second step's inputs differ from the first's, and the step compiles twice."""
        if self.mesh is None:
            return
        import torch_xla.distributed.spmd as xs

        for tensor in tensors:
            xs.mark_sharding(tensor, self.mesh, replicated(tensor))

    def input_sharding(self):
        """For the data loader: each host's batch is its slice of the global batch, split on the
        batch dimension across the mesh (None under dp: a batch goes to one chip)."""
        if self.mesh is None:
            return None
        import torch_xla.distributed.spmd as xs

        return xs.ShardingSpec(self.mesh, (BATCH_AXES, None), minibatch=True)

    def describe(self) -> dict:
        described = {"mode": self.mode, "processes": self.world, "chips": self.chips}
        if self.mesh is not None:
            described["mesh"] = dict(zip(self.mesh.axis_names, self.mesh.mesh_shape))
        return described


def start(mode: str, mesh: tuple[int, int] = (1, -1), host_timeout_s: float = 1800) -> tuple[Parallel, torch.device]:
    """Initialise the runtime for `mode` on this replica and return (Parallel, device).
    mesh: (data, fsdp) axis sizes under fsdp, -1 for "the remaining chips".
    Under fsdp this must run before any XLA tensor exists (SPMD is a process-wide switch); so
    must use_compile_cache, once per process, before (launch.py)."""
    choose_device()
    import torch_xla.runtime as xr

    if mode == "fsdp":
        xr.use_spmd()

    device = init_xla_device()  # before any backward in this process
    if torchrun_world() > 1:
        # Processes started by torchrun on a CPU: each is its own XLA world of one; they talk
        # through gloo on the host (torchrun's MASTER_ADDR/PORT), device sums included.
        rank, world = int(os.environ["RANK"]), torchrun_world()
        collectives = Collectives(rank, world, "host", *replica_group("env://", rank, world, host_timeout_s))
    elif mode == "dp":
        # One replica per device: the launcher's threads (launch.py), one or two per process.
        # XLA:CPU cannot all-reduce across threads, so there the device sums go through gloo.
        rank, world = xr.global_ordinal(), xr.world_size()
        group = replica_group("xla://", rank, world, host_timeout_s) if world > 1 else (None, None)
        collectives = Collectives(rank, world, "xla" if device_kind() != "CPU" else "host", *group)
    else:
        rank, world = xr.process_index(), xr.process_count()
        group = replica_group("xla://", rank, world, host_timeout_s) if world > 1 else (None, None)
        collectives = Collectives(rank, world, "none", *group)
    if mode == "dp":
        return Parallel("dp", collectives), device
    import torch_xla.distributed.spmd as xs

    # The mesh spans every chip of the SPMD program: all hosts' on a pod, this process's own
    # under torchrun (where each process is a separate XLA world).
    chips = xr.global_runtime_device_count()
    data, fsdp = mesh_shape(chips, *mesh)
    spmd_mesh = xs.Mesh(np.arange(chips), (data, fsdp), (DATA_AXIS, FSDP_AXIS))
    return Parallel("fsdp", collectives, chips_per_process=xr.addressable_runtime_device_count(),
                    mesh=spmd_mesh), device


def use_compile_cache(setting: str, mode: str, local_process: int) -> None:
    """Turn on XLA's persistent compilation cache for this process (xla.compile_cache_dir), in
    a directory of its own: processes of one host may not share one. Once per process, before
    its first computation: the replica threads of a process share its cache."""

    directory = compile_cache_dir(setting)
    if not directory:
        return
    import torch_xla
    import torch_xla.runtime as xr

    xr.initialize_cache(str(Path(directory).expanduser() / (
        f"torch_xla-{torch_xla.__version__}-{os.environ.get('PJRT_DEVICE', 'CPU').lower()}-{mode}-{local_process}")),
        readonly=False)


def mesh_shape(chips: int, data: int, fsdp: int) -> tuple[int, int]:
    """(data, fsdp) for `chips` chips; one of them may be -1 (the rest). Raises ValueError
    naming the config keys when the product is not the chip count."""
    if data == -1 and fsdp == -1:
        raise ValueError("parallel.mesh: at most one of data and fsdp may be -1")
    if data == -1:
        data = chips // fsdp if chips % fsdp == 0 else -1
    if fsdp == -1:
        fsdp = chips // data if chips % data == 0 else -1
    if data < 1 or fsdp < 1 or data * fsdp != chips:
        raise ValueError(f"parallel.mesh: data x fsdp must equal the {chips} chips of the mesh "
                         f"(got data={data}, fsdp={fsdp}); e.g. parallel.mesh.data=1 parallel.mesh.fsdp=-1")
    return data, fsdp


def compile_cache_dir(setting: str) -> str:
    """xla.compile_cache_dir resolved: "" -> off; "auto" -> the user's cache directory on an
    accelerator, off on XLA:CPU, where torch_xla 2.9 writes entries it then cannot load
    (PersistentCacheDeserializeFailure on every graph: measured, no time saved)."""

    if setting != "auto":
        return setting
    if os.environ.get("PJRT_DEVICE", "CPU") == "CPU":
        return ""
    return str(Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "tpu-lora" / "xla")


def shard_spec(param: torch.Tensor, chips: int) -> tuple | None:
    """Shard a weight matrix on its first dimension divisible by the fsdp axis size; None
    (replicate) for vectors, for matrices no dimension of which divides, and for an fsdp axis
    of one chip (pure data parallelism)."""
    if param.dim() < 2 or chips < 2:
        return None
    for dim, size in enumerate(param.shape):
        if size % chips == 0:
            return tuple(FSDP_AXIS if d == dim else None for d in range(param.dim()))
    return None


def replicated(tensor: torch.Tensor) -> tuple:
    return (None,) * tensor.dim()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM (`...DecoderLayer`)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
