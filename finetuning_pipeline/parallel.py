"""How the chips share one run: data parallel processes (`dp`) or one SPMD program (`fsdp`).

dp (the default for models that fit a chip): one process per chip, each with a full copy of
the model and its own slice of every global batch; gradients, loss sums and eval sums are
all-reduced explicitly (`xm.all_reduce`).

fsdp: one process per host, `xr.use_spmd()`, and a 1-D mesh named `fsdp` over every chip of
every host. The frozen base weights are sharded along it (each chip holds 1/N of each
matrix), so a model bigger than one chip's HBM fits; each chip computes its share of the
batch, and XLA's SPMD partitioner inserts the all-gathers of weights and the reductions of
gradients. The LoRA parameters, their gradients and the optimizer state are replicated: they
are small (under 1% of a 7B model at r 16), a replicated update needs no collective, and a
replicated tensor is whole on every host, so saving gathers the real trained values by
construction (`.cpu()` of a replicated tensor is the full tensor).

Every process calls the same functions in the same order; `Parallel` holds what differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

MODES = ("dp", "fsdp")
FSDP_AXIS = "fsdp"


@dataclass
class Parallel:
    """mode: "dp" or "fsdp".
    rank, world: this process among the processes that read data (under fsdp: hosts).
    chips_per_process: how many chips one process's batches feed (1 under dp).
    mesh: the SPMD mesh under fsdp, None under dp."""

    mode: str
    rank: int
    world: int
    chips_per_process: int = 1
    mesh: object = None

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def chips(self) -> int:
        return self.world * self.chips_per_process

    @property
    def explicit_reduce(self) -> bool:
        """True where the trainer must all-reduce sums itself (dp with several processes);
        under fsdp every tensor is global and the compiler does it."""
        return self.mode == "dp" and self.world > 1

    def place_model(self, model: torch.nn.Module, device) -> list[str]:
        """Move the model to the device; under fsdp shard frozen weights as they arrive, so no
        chip ever holds a full copy of the model (moving it whole would need one). Returns the
        names of the sharded parameters."""
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
                    spec = shard_spec(param, self.mesh.size()) if not param.requires_grad else None
                    if spec is not None:
                        sharded.append(f"{module_name}.{name}")
                    xs.mark_sharding(on_device, self.mesh, spec or replicated(param))
                    moved[id(param)] = on_device
                setattr(module, name, moved[id(param)])
        model.to(device)  # buffers (rotary tables): small, replicated
        for layer in decoder_layers(model):
            layer.register_forward_hook(self._shard_hidden_states)
        return sharded

    def _shard_hidden_states(self, module, inputs, output):
        # Pin each decoder layer's output to batch sharding (as torch_xla's FSDPv2 does), so
        # the partitioner gathers weights rather than resharding activations by feature.
        import torch_xla.distributed.spmd as xs

        hidden = output[0] if isinstance(output, tuple) else output
        xs.mark_sharding(hidden, self.mesh, (FSDP_AXIS,) + (None,) * (hidden.dim() - 1))
        return output

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
        """For MpDeviceLoader: each host's batch is its slice of the global batch, split on the
        batch dimension across the mesh (None under dp: a batch goes to one chip)."""
        if self.mesh is None:
            return None
        import torch_xla.distributed.spmd as xs

        return xs.ShardingSpec(self.mesh, (FSDP_AXIS, None), minibatch=True)

    def any_process(self, flag: bool, tag: str) -> bool:
        """True on every process if it is True on any (all processes must stop at one step)."""
        if self.world == 1:
            return flag
        if self.mode == "dp":
            import torch_xla.core.xla_model as xm

            return bool(xm.mesh_reduce(tag, int(flag), max))
        import torch.distributed as dist

        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)  # gloo, host memory: the chips are not involved
        return bool(value.item())

    def barrier(self, tag: str) -> None:
        if self.world == 1:
            return
        if self.mode == "dp":
            import torch_xla.core.xla_model as xm

            xm.rendezvous(tag)
            return
        import torch.distributed as dist

        dist.barrier()

    def describe(self) -> dict:
        return {"mode": self.mode, "processes": self.world, "chips": self.chips}


def start(mode: str, local_index: int = 0, compile_cache_dir: str = "") -> tuple[Parallel, torch.device]:
    """Initialise the runtime for `mode` in this process and return (Parallel, device).
    Under fsdp this must run before any XLA tensor exists (SPMD is a process-wide switch);
    so must the compilation cache (one directory per local process: they may not share one)."""
    import os

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla
    import torch_xla.runtime as xr

    if compile_cache_dir:
        cache = Path(compile_cache_dir).expanduser() / (
            f"torch_xla-{torch_xla.__version__}-{os.environ['PJRT_DEVICE'].lower()}-{mode}-{local_index}")
        xr.initialize_cache(str(cache), readonly=False)
    if mode == "fsdp":
        xr.use_spmd()
    from utils.xla_runtime import init_xla_device

    device = init_xla_device()  # before any backward in this process
    if mode == "dp":
        return Parallel("dp", rank=xr.global_ordinal(), world=xr.world_size()), device
    import numpy as np
    import torch_xla.distributed.spmd as xs

    chips = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(chips), (chips,), (FSDP_AXIS,))
    if xr.process_count() > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// rendezvous

            dist.init_process_group("gloo", init_method="xla://")  # host-side stop votes and barriers
    return Parallel("fsdp", rank=xr.process_index(), world=xr.process_count(),
                    chips_per_process=xr.addressable_runtime_device_count(), mesh=mesh), device


def compile_cache_dir(setting: str) -> str:
    """xla.compile_cache_dir resolved: "" -> off; "auto" -> the user's cache directory on an
    accelerator, off on XLA:CPU, where torch_xla 2.9 writes entries it then cannot load
    (PersistentCacheDeserializeFailure on every graph: measured, no time saved)."""
    import os

    if setting != "auto":
        return setting
    if os.environ.get("PJRT_DEVICE", "CPU") == "CPU":
        return ""
    return str(Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "tpu-lora" / "xla")


def shard_spec(param: torch.Tensor, chips: int) -> tuple | None:
    """Shard a weight matrix on its first dimension divisible by the chip count; None
    (replicate) for vectors and for matrices no dimension of which divides."""
    if param.dim() < 2:
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
