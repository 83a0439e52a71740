"""How the chips share one run, in the terms every runtime shares: data parallel replicas, each
with a whole model and its own slice of every global batch (`Parallel`), the mesh arithmetic of
parallel.mode=fsdp, and where a model's repeated blocks are.

Each runtime shards its own way, in a subclass of its own: torch_xla's SPMD over a 2-D mesh
(runtime/xla/spmd.py) and FSDP2 over torch's DeviceMesh (runtime/native/fsdp.py). Every process
calls the same functions in the same order; `Parallel` holds what differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from finetuning_pipeline.distributed.collectives import Collectives

DATA_AXIS, FSDP_AXIS = "data", "fsdp"
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)  # the batch is split over both axes


@dataclass
class Parallel:
    """How this replica shares the run, the plain way: a whole model on its device and its own
    slice of every global batch (dp), or one process of one device.
    mode: "dp" or "fsdp" (parallel.mode).
    collectives: this process's rank among the processes that read data (under XLA's fsdp:
        hosts), their number, how they talk and how they sum device tensors.
    chips_per_process: how many chips one process's batches feed (1 but under XLA's SPMD).
    A runtime's sharded modes are its own subclasses (runtime/xla/spmd.py, runtime/native/fsdp.py)."""

    mode: str
    collectives: Collectives = field(default_factory=Collectives)
    chips_per_process: int = 1

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

    @property
    def shards_batch_in_process(self) -> bool:
        """One program over several chips that splits each batch itself (XLA's SPMD): attention
        kernels that need it, and dp's per-process arithmetic, ask."""
        return False

    def place_model(self, model: torch.nn.Module, device) -> list[str]:
        """Move the model to the device; returns the names of the tensors sharded (none here)."""
        model.to(device)
        return []

    def replicate(self, tensors: list[torch.Tensor]) -> None:
        """Mark trainer state (LoRA parameters, optimizer state, counters) whole on every chip of a
        sharded program: nothing to mark where each process holds its own."""

    def shard_optimizer_state(self, tensors: list[torch.Tensor]) -> None:
        """Split the optimizer's flat moments over the chips of a sharded program (embeddings
        trained whole: runtime/xla/spmd.py); where each process holds its own, they stay whole."""
        self.replicate(tensors)

    def input_sharding(self):
        """How a host batch is split over this process's chips: None, it goes to one device."""
        return None

    def describe(self) -> dict:
        return {"mode": self.mode, "processes": self.world, "chips": self.chips}


def mesh_shape(chips: int, data: int, fsdp: int) -> tuple[int, int]:
    """(data, fsdp) for `chips` devices (a TPU's chips, or GPUs); one of them may be -1 (the rest).
    Raises ValueError naming the config keys when the product is not the device count."""
    if data == -1 and fsdp == -1:
        raise ValueError("parallel.mesh: at most one of data and fsdp may be -1")
    if data == -1:
        data = chips // fsdp if chips % fsdp == 0 else -1
    if fsdp == -1:
        fsdp = chips // data if chips % data == 0 else -1
    if data < 1 or fsdp < 1 or data * fsdp != chips:
        raise ValueError(f"parallel.mesh: data x fsdp must equal the {chips} devices of the mesh "
                         f"(got data={data}, fsdp={fsdp}); e.g. parallel.mesh.data=1 parallel.mesh.fsdp=-1")
    return data, fsdp


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
