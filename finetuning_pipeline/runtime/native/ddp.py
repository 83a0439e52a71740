"""parallel.mode=dp on the native runtime: processes started by torchrun, each a replica of the
model, their LoRA gradients summed by PyTorch's DistributedDataParallel.

DDP sums a step's gradients once, in the backward of its last micro-batch, as that backward
produces them (the micro-batches before it run under `no_sync()` and add to the `.grad`s: the
one micro-batch loop, train/step.py's train_step given the DDP module): the reduction overlaps
the backward instead of following it. Two things differ from DDP's defaults:
- it sums rather than averages (a comm hook): the step divides by the label tokens of every
  micro-batch of every replica (train/step.py), so k micro-batches on n replicas give the
  gradient of one batch of n*k;
- the frozen base is none of its business: only the LoRA weights require gradients, and the
  base's weights and buffers are left out of its start-up broadcast (a 7B base would cross the
  network once per process for nothing: every replica loads the same one).
The loss sums and label tokens are summed with one all-reduce by the replicas' Collectives.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from finetuning_pipeline.errors import ReplicaLost
from finetuning_pipeline.model.causal_lm_loss import causal_lm_loss_sum


class BatchLoss(torch.nn.Module):
    """What DDP wraps: a micro-batch's loss sums and label tokens (causal_lm_loss_sum), or a
    preference objective's sums (train/step.py), so that the trainer's own forward, the chunked
    loss included, is DDP's."""

    def __init__(self, model: torch.nn.Module, packed: bool, loss_chunk: int, groups: int, objective=None) -> None:
        super().__init__()
        self.model, self.packed, self.loss_chunk, self.groups = model, packed, loss_chunk, groups
        self.objective = objective

    def forward(self, batch: dict[str, torch.Tensor]):
        if self.objective is not None:
            return self.objective(self.model, batch, self.groups)
        return causal_lm_loss_sum(self.model, batch, self.packed, self.loss_chunk, groups=self.groups)


def summed(group, bucket):  # (unannotated: DDP refuses a return annotation that is a string)
    """DDP's comm hook: the bucket's gradients summed over the replicas (its default averages); a
    future of the sum."""
    return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def replicate(model: torch.nn.Module, packed: bool, loss_chunk: int, groups: int,
              device: torch.device, objective=None) -> DistributedDataParallel:
    """The model's loss under DDP, in torch.distributed's default process group (runtime/native/runtime.py)."""
    module = BatchLoss(model, packed, loss_chunk, groups, objective)
    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, frozen + [name for name, _ in module.named_buffers()])
    # (every buffer is ignored above, so DDP has none to broadcast at each forward: its broadcast_buffers,
    # deprecated from torch 2.13, is left at its default)
    ddp = DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)
    ddp.register_comm_hook(None, summed)
    return ddp


@contextlib.contextmanager
def lost_replica_named(collectives):
    """Around a step whose gradients DDP sums: a peer gone then (its sockets closed: a gloo or NCCL
    error from the reduction) is ReplicaLost, as in the replicas' own collectives; every other
    error goes through as it is."""
    try:
        yield
    except RuntimeError as err:
        if not any(name in str(err) for name in ("gloo", "NCCL")):
            raise
        raise ReplicaLost.of(collectives.rank, " in the gradients' sum", err) from None
