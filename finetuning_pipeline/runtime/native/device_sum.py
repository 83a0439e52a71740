"""How the native runtime sums device tensors over torchrun's processes (distributed/collectives.py's
DeviceSum): torch.distributed's default process group, on the device's own backend (gloo on a CPU,
NCCL on CUDA, TorchTPU's tpu_dist), on the device with no host round trip. Under dp the LoRA
gradients are summed by DistributedDataParallel (ddp.py); the loss sums, label tokens and eval
sums here."""

from __future__ import annotations

import torch
import torch.distributed as dist

from finetuning_pipeline.distributed.collectives import Collectives, summed_flat


class TorchAllReduce:
    def sum(self, collectives: Collectives, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        def all_reduced(flat: torch.Tensor) -> torch.Tensor:
            collectives.wait_for(lambda: dist.all_reduce(flat, dist.ReduceOp.SUM, async_op=True))
            return flat

        return summed_flat(tensors, all_reduced)

    def close(self) -> None:
        dist.destroy_process_group()
