"""How the native runtime runs an optimizer step (runtime/protocol.py's StepExecution): train/step.py's
micro-batch gradients, sums and masked AdamW update, run by PyTorch as it goes, with each
decoder layer compiled by torch.compile where runtime.compile says (compile_decoder_layers, which
the runtime's parallelize applies), and under torchrun with parallel.mode=dp the gradients
summed by DistributedDataParallel (ddp.py).

What the XLA runtime does with a captured graph is done here by eager PyTorch: the step's
kernels are queued as the Python runs, nothing of a step is read on the host, and a log step
reads its results after the step. Random numbers: LoRA dropout takes its masks from the seed of
each micro-batch (lora_logic/dropout.py), the model's own dropout from torch's RNG, seeded per
micro-batch here, and torch.utils.checkpoint restores that RNG when it recomputes a layer, so a
recomputed layer draws the masks of its forward and a resumed run the uninterrupted one's.

Compiled layers (runtime.compile=layers): each decoder layer's forward is compiled on its own
(`nn.Module.compile`): the layers share their compiled graphs, so a model compiles one layer's
forward and backward, not its depth (tested), and the LoRA's shared A products
(lora_logic/layer.py's SharedInput) are traced with the layer.
"""

from __future__ import annotations

import contextlib

import torch

from finetuning_pipeline.distributed.parallel import decoder_layers
from finetuning_pipeline.run_config import TrainConfig
from finetuning_pipeline.runtime.native.ddp import lost_replica_named, replicate
from finetuning_pipeline.train.step import train_step
from lora_logic.dropout import SeededDropout
from utils.precision import compiled_in_float64


class NativeStepExecution:
    note = None
    updated_state_tensors = updated_state_bytes = None  # (no buffers are donated: PyTorch frees what it drops)

    def __init__(self, model, optimizer, *, train: TrainConfig, parallel, device, packed: bool, loss_chunk: int,
                 activation_checkpointing: bool, objective=None) -> None:
        self.model, self.optimizer, self.parallel = model, optimizer, parallel
        self.packed, self.loss_chunk, self.max_grad_norm = packed, loss_chunk, train.max_grad_norm
        self.objective = objective  # a preference phase's loss (train/step.py), or None
        self.ddp = None
        if parallel.world > 1 and parallel.mode == "dp":  # DDP sums the gradients (ddp.py)
            self.ddp = replicate(model, packed, loss_chunk, optimizer.group_count, device, objective)

    def seed_rng(self, seed: int) -> None:
        torch.manual_seed(seed)  # every device's default generator (CPU and CUDA alike)

    def run(self, micro_batches: list[dict], seeds: list[int], lr_and_active, lr_examples) -> dict:
        self.optimizer.lr, active = lr_and_active()
        with lost_replica_named(self.parallel.collectives) if self.ddp is not None else contextlib.nullcontext():
            return train_step(self.model, self.optimizer, micro_batches, max_grad_norm=self.max_grad_norm,
                              collectives=self.parallel.collectives, packed=self.packed, loss_chunk=self.loss_chunk,
                              seeds=seeds, active=active, seed_rng=self.seed_rng, replicated=self.ddp,
                              objective=self.objective)


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile each decoder layer's forward in place (once per model: a layer already compiled is
    left as it is); returns how many layers are compiled. The layers share their graphs (one for
    training, one for evaluation, whatever the depth) as long as nothing per layer is guarded on:
    the trainer's forward passes use_cache=False, as a KV cache's per-layer state would compile
    each layer anew until dynamo's cache limit (8) left the rest eager."""
    layers = decoder_layers(model)
    if any(p.dtype == torch.float64 for p in model.parameters()):  # (one backend: the layers share its graphs)
        backend = compiled_in_float64(backend)
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is None:
            device = next(layer.parameters()).device
            for module in layer.modules():
                if isinstance(module, SeededDropout):
                    module.salt_as_data(device)  # (a layer's own int would be a constant of its graph)
            layer.compile(dynamic=False, backend=backend)
    return len(layers)
