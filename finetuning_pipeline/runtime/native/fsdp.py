"""parallel.mode=fsdp on the native runtime: FSDP2 (torch.distributed's `fully_shard`, DTensor)
shards the frozen base of every decoder layer over the processes torchrun started.

As on the XLA runtime (distributed/parallel.py), each process holds 1/F of each layer's frozen
weights along the mesh's `fsdp` axis and gathers a layer's whole weights for its forward and
again for its backward; the LoRA weights, their gradients and the optimizer state stay whole on
every process (FSDP2's ignored parameters: small, and an update on whole tensors needs no
collective), their gradients summed over the processes with the loss sums (Collectives' "torch"
reduction). With parallel.mesh.data > 1 the mesh is 2-D: FSDP2 shards over `fsdp` and
replicates over `data` (HSDP). Each process is one device and reads its own slice of every
global batch, as under dp: the batch arithmetic is dp's. The layers outside the decoder stack
(embeddings, final norm, LM head) stay whole.

A quantized base shards its codes and scales, so what a layer gathers is its codes (1 byte or
half a byte a weight), never its dequantized weight, which exists only inside the matmul as on
one device. FSDP2 holds floating-point parameters only (an int8 one fails: "only Tensors of
floating point dtype can require gradients"), so the codes are held as float16 bits
(QuantizedLinear.hold_codes_as): a gather moves bytes and does no arithmetic, and the layer reads
them back as its codes, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetuning_pipeline.distributed.parallel import DATA_AXIS, FSDP_AXIS, Parallel, decoder_layers, mesh_shape
from finetuning_pipeline.errors import ConfigError
from lora_logic.quantized_linear import QuantizedLinear


def device_mesh(device: torch.device, processes: int, data: int, fsdp: int):
    """torch's DeviceMesh of parallel.mesh over the processes: 1-D (`fsdp`) when data is 1."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        data, fsdp = mesh_shape(processes, data, fsdp)
    except ValueError as err:
        raise ConfigError(f"{err} (on the native runtime the mesh spans torchrun's {processes} processes)") from None
    mesh = init_device_mesh(device.type, (data, fsdp), mesh_dim_names=(DATA_AXIS, FSDP_AXIS))
    return mesh[FSDP_AXIS] if data == 1 else mesh


@dataclass
class NativeFsdp(Parallel):
    """Parallel for FSDP2: its mesh is torch's DeviceMesh (1-D over `fsdp`, or 2-D `data` x `fsdp`),
    and placing the model shards it."""

    mesh: object = None

    def place_model(self, model: torch.nn.Module, device) -> list[str]:
        """Shard each decoder layer's frozen weights onto the device, then move the rest of the
        model there; returns the names of what FSDP2 holds. The base arrives on the host: FSDP2
        moves a layer to the device and shards it there, layer after layer, so a device never
        holds more than one whole layer beside its shards."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        for layer in decoder_layers(model):
            for module in layer.modules():
                if isinstance(module, QuantizedLinear):  # its codes and scales shard as its weight would
                    module.hold_codes_as(torch.float16)
            fully_shard(layer, mesh=self.mesh, ignored_params={p for p in layer.parameters() if p.requires_grad})
        model.to(device)  # the LoRA weights, embeddings, final norm and LM head (a sharded weight is there already)
        return [name for name, p in model.named_parameters() if isinstance(p, DTensor)]

    def describe(self) -> dict:
        shape = dict(zip(self.mesh.mesh_dim_names, self.mesh.shape))
        return {"mode": self.mode, "processes": self.world, "chips": self.chips,
                "mesh": {DATA_AXIS: shape.get(DATA_AXIS, 1), FSDP_AXIS: shape[FSDP_AXIS]}}
