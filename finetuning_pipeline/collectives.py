"""How replicas talk: the one module that knows.

Two kinds of traffic:
- Host decisions every replica must take together (stop at this step, the checkpoint was
  written, wait here) go through a `torch.distributed` gloo process group on the host: a vote
  is one small TCP round trip and never touches the device. (torch_xla 2.9's
  `xm.rendezvous`/`xm.mesh_reduce` all-gather on the device and sync the graph first:
  `xla_model.xla_rendezvous`, a host sync per vote.) A peer that dies closes its sockets, so a
  vote fails at once on the others instead of hanging.
- Device sums (gradients, loss and token counts, eval sums), in one of three ways:
  "none"      nothing to reduce: one process, or one SPMD program whose mesh spans every chip
              (the partitioner inserts the reductions);
  "xla"       `xm.all_reduce` inside the step's graph (one process per TPU chip);
  "host"      through gloo via host memory: processes started by `torchrun` on a CPU, where
              XLA:CPU has no cross-process collectives (pytorch/xla#5342). This costs a sync
              and a transfer per step: it exists so the multi-process control flow runs on a
              CPU exactly as on a pod, not for speed.
"""

from __future__ import annotations

import datetime
import os

import torch

from finetuning_pipeline.errors import ReplicaLost

DEVICE_REDUCTIONS = ("none", "xla", "host")


def torchrun_world() -> int:
    """The number of processes `torchrun` started (1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "TORCHELASTIC_RUN_ID" in os.environ else 1


def launch_rank() -> int:
    """This process's rank among the processes torchrun started (0 when not under torchrun)."""
    return int(os.environ.get("RANK", "0")) if torchrun_world() > 1 else 0


def init_host_group(init_method: str | None = None, timeout_s: float = 1800) -> None:
    """The gloo process group for host collectives. `init_method` None reads torchrun's
    environment (MASTER_ADDR, RANK, ...); "xla://" asks the PJRT runtime (TPU processes)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if init_method == "xla://":
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// rendezvous
    dist.init_process_group("gloo", init_method=init_method, timeout=datetime.timedelta(seconds=timeout_s))


class Collectives:
    """rank, world: this process among the processes that feed data. device_reduction: how
    device tensors are summed across them (see the module docstring)."""

    def __init__(self, rank: int = 0, world: int = 1, device_reduction: str = "none") -> None:
        if device_reduction not in DEVICE_REDUCTIONS:
            raise ValueError(f"device_reduction must be one of {DEVICE_REDUCTIONS}, got {device_reduction!r}")
        self.rank = rank
        self.world = world
        self.device_reduction = device_reduction if world > 1 else "none"

    # -- host decisions -----------------------------------------------------------------------
    def _host_max(self, value: int) -> int:
        if self.world == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64)
        self._all_reduce(tensor, dist.ReduceOp.MAX)
        return int(tensor.item())  # a host tensor: no device sync

    def _all_reduce(self, host_tensor: torch.Tensor, op) -> None:
        import torch.distributed as dist

        try:
            dist.all_reduce(host_tensor, op=op)
        except RuntimeError as err:  # gloo: "Connection closed by peer", a timeout, ...
            raise ReplicaLost(f"replica {self.rank}: another replica stopped answering ({err}); the run "
                              "resumes from its last complete checkpoint with --resume auto") from None

    def any(self, flag: bool) -> bool:
        """True on every replica if it is True on any."""
        return bool(self._host_max(int(bool(flag))))

    def all(self, flag: bool) -> bool:
        """True on every replica if it is True on all."""
        return not self.any(not flag)

    def barrier(self) -> None:
        self._host_max(0)

    def close(self) -> None:
        """The end of a run that every replica reached: wait for all, then take the host group
        down in order. (Left to the interpreter's exit, a replica of a CI rehearsal once
        aborted after finishing: "terminate called without an active exception".)"""
        import torch.distributed as dist

        if dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()

    # -- device sums --------------------------------------------------------------------------
    def sum_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor summed over the replicas (same shapes on every replica); returns the
        sums (the same tensors, reduced in place, under XLA collectives)."""
        if self.device_reduction == "none":
            return tensors
        if self.device_reduction == "xla":
            import torch_xla.core.xla_model as xm

            xm.all_reduce(xm.REDUCE_SUM, tensors)  # a list is reduced in place, in one collective
            return tensors
        import torch.distributed as dist
        import torch_xla

        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
        torch_xla.sync()  # materialise before the transfer; one graph, the same every step
        host = flat.cpu()
        self._all_reduce(host, dist.ReduceOp.SUM)
        flat = host.to(tensors[0].device)
        out, offset = [], 0
        for t in tensors:
            out.append(flat[offset:offset + t.numel()].reshape(t.shape).to(t.dtype))
            offset += t.numel()
        return out
