"""parallel.mode=fsdp on the XLA runtime: one SPMD program per host (`xr.use_spmd()`) over a 2-D
mesh (`data`, `fsdp`) of every chip of every host (MaxText's data and fsdp parallelism).

The frozen base weights are sharded along `fsdp` (each chip of a data group holds 1/F of each
matrix), so a model bigger than one chip's HBM fits; the batch is split over both axes, and
XLA's SPMD partitioner inserts the all-gathers of weights and the reductions of gradients. With
`fsdp` = 1 nothing is sharded: pure data parallelism in one process per host, one compile per
host instead of one per chip. The LoRA parameters, their gradients and the optimizer state are
replicated: they are small (under 1% of a 7B model at r 16), a replicated update needs no
collective, and a replicated tensor is whole on every host, so saving gathers the real trained
values by construction. Embeddings trained whole beside the LoRA (lora.modules_to_save) are not
small (Mistral-7B's two matrices: 268M weights, Gemma 3's far more): their trainable copies are
sharded as the base's matrices are, and the optimizer's moments along `fsdp` too, so no chip
holds their whole AdamW state (shard_optimizer_state); saving gathers them (a device-to-host copy
of a sharded tensor is the whole tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetuning_pipeline.distributed.parallel import BATCH_AXES, Parallel, decoder_layers, replicated, shard_spec
from lora_logic.adapters import is_whole_module_weight
from lora_logic.quantized_linear import QuantizedLinear


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether an XLA tensor carries a sharding other than replicated."""
    import torch_xla

    spec = torch_xla._XLAC._get_xla_sharding_spec(tensor)
    return bool(spec) and "replicated" not in spec


@dataclass
class SpmdParallel(Parallel):
    """mesh: the SPMD mesh (torch_xla.distributed.spmd.Mesh) over the program's chips."""

    mesh: object = None

    @property
    def shards_batch_in_process(self) -> bool:
        return True

    def fsdp_size(self) -> int:
        return self.mesh.mesh_shape[1]

    def place_model(self, model: torch.nn.Module, device) -> list[str]:
        """Move the model to the device, sharding frozen weights (and a quantized base's codes and
        scales) as they arrive, so no chip ever holds a full copy of the model (moving it whole
        would need one). Returns the names of the sharded tensors."""
        import torch_xla.distributed.spmd as xs

        sharded = []
        moved: dict[int, torch.nn.Parameter] = {}  # tied weights (embeddings = lm_head) move once
        for module_name, module in model.named_modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) not in moved:
                    on_device = torch.nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
                    whole_trained = param.requires_grad and is_whole_module_weight(f"{module_name}.{name}")
                    spec = shard_spec(param, self.fsdp_size()) if not param.requires_grad or whole_trained else None
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
        for the matmul, 2 to 4 times the codes' bytes."""
        import torch_xla.distributed.spmd as xs

        xs.mark_sharding(tensor, self.mesh, replicated(tensor))
        return tensor

    def replicate(self, tensors: list[torch.Tensor]) -> None:
        """Mark trainer state (LoRA parameters, optimizer state, counters) replicated. Without
        the mark, their shardings after the first step are whatever propagation chose, the
        second step's inputs differ from the first's, and the step compiles twice."""
        import torch_xla.distributed.spmd as xs

        for tensor in tensors:
            if is_sharded(tensor):  # a trained embedding place_model sharded keeps its sharding
                continue
            xs.mark_sharding(tensor, self.mesh, replicated(tensor))

    def shard_optimizer_state(self, tensors: list[torch.Tensor]) -> None:
        """The optimizer's flat moments split along `fsdp` (each chip 1/F of them): where embeddings
        are trained whole, most of the state is theirs. Replicated on an fsdp axis of one chip."""
        import torch_xla
        import torch_xla.distributed.spmd as xs

        for tensor in tensors:
            spec = ("fsdp",) if self.fsdp_size() > 1 and tensor.dim() == 1 else replicated(tensor)
            xs.mark_sharding(tensor, self.mesh, spec)
        # As XLA holds them (the summary reports it): e.g. "{devices=[2]0,1}", each chip half.
        self.optimizer_state_sharding = [torch_xla._XLAC._get_xla_sharding_spec(t) for t in tensors]

    def input_sharding(self):
        """For the data loader: each host's batch is its slice of the global batch, split on the
        batch dimension across the mesh."""
        import torch_xla.distributed.spmd as xs

        return xs.ShardingSpec(self.mesh, (BATCH_AXES, None), minibatch=True)

    def describe(self) -> dict:
        described = {**super().describe(), "mesh": dict(zip(self.mesh.axis_names, self.mesh.mesh_shape))}
        if getattr(self, "optimizer_state_sharding", None):
            described["optimizer_state_sharding"] = self.optimizer_state_sharding
        return described
