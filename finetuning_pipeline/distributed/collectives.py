"""How replicas talk: the one module that knows.

Two kinds of traffic:
- Host decisions every replica must take together (stop at this step, the checkpoint was
  written, wait here) go through a gloo group on the host: a vote is one small TCP round trip
  and never touches the device. Each replica has a group object of its own, not
  torch.distributed's process-wide default group: on TPU v2/v3 a process runs two replicas
  as threads (launch.py), and one default group per process cannot hold both ranks. (torch_xla 2.9's
  `xm.rendezvous`/`xm.mesh_reduce` all-gather on the device and sync the graph first:
  `xla_model.xla_rendezvous`, a host sync per vote.) A peer that dies closes its sockets, so a
  vote fails at once on the others instead of hanging.
- Device sums (gradients, loss and token counts, eval sums), in one of four ways:
  "none"      nothing to reduce: one process, or one SPMD program whose mesh spans every chip
              (the partitioner inserts the reductions);
  "xla"       `xm.all_reduce` inside the step's graph (one process per TPU chip);
  "host"      through gloo via host memory: processes started by `torchrun` on a CPU, where
              XLA:CPU has no cross-process collectives (pytorch/xla#5342). This costs a sync
              and a transfer per step: it exists so the multi-process control flow runs on a
              CPU exactly as on a pod, not for speed;
  "torch"     the native runtime's processes: torch.distributed's default process group, on
              the device's own backend (gloo on a CPU, NCCL on CUDA); under dp the gradients
              are summed by DistributedDataParallel (runtime/native/ddp.py), the rest here.
"""

from __future__ import annotations

import datetime
import json
import os

import torch

from finetuning_pipeline.errors import ReplicaLost
from utils.precision import at_least_fp32

DEVICE_REDUCTIONS = ("none", "xla", "host", "torch")


def torchrun_world() -> int:
    """The number of processes `torchrun` started (1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "TORCHELASTIC_RUN_ID" in os.environ else 1


def launch_rank() -> int:
    """This process's rank among the processes torchrun started (0 when not under torchrun)."""
    return int(os.environ.get("RANK", "0")) if torchrun_world() > 1 else 0


def replica_group(init_method: str, rank: int, world: int, timeout_s: float = 1800):
    """This replica's gloo group. `init_method` "env://" reads torchrun's environment
    (MASTER_ADDR, RANK, ...); "xla://" asks torch_xla's rendezvous (TPU processes, which finds
    the master host). Returns (group, stores); keep the stores alive as long as the group."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if init_method == "xla://":
        import torch_xla.distributed.xla_backend  # noqa: F401 - registers the xla:// rendezvous
    store, _, _ = next(dist.rendezvous(init_method, timeout=timeout))
    client = store
    if isinstance(store, dist.TCPStore):
        # A client of its own: torch_xla hands every thread of a process the same store, and
        # two replica threads waiting on one socket block each other in gloo's rendezvous
        # (measured: the second group never connects).
        client = dist.TCPStore(store.host, store.port, is_master=False, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore("tpu-lora/replicas", client), rank, world, timeout)
    return group, (store, client)  # rank 0's store is the server the others connect to


class Collectives:
    """rank, world: this process among the processes that feed data. device_reduction: how
    device tensors are summed across them (see the module docstring)."""

    def __init__(self, rank: int = 0, world: int = 1, device_reduction: str = "none", group=None,
                 stores=None) -> None:
        if device_reduction not in DEVICE_REDUCTIONS:
            raise ValueError(f"device_reduction must be one of {DEVICE_REDUCTIONS}, got {device_reduction!r}")
        if world > 1 and group is None:
            raise ValueError("several replicas need a host group (replica_group)")
        self.rank = rank
        self.world = world
        self.device_reduction = device_reduction if world > 1 else "none"
        self.group, self._stores = group, stores  # the stores must outlive the group

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

        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._wait(lambda: self.group.allreduce([host_tensor], options))

    def _wait(self, collective) -> None:
        try:
            collective().wait()
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

    def gather(self, value) -> list:
        """`value` (anything JSON can write) from every replica, in rank order, on every replica."""
        if self.world == 1:
            return [value]
        payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        size = self._host_max(payload.numel())
        padded = torch.zeros(size + 8, dtype=torch.uint8)  # 8 bytes of length, then the text
        padded[:8] = torch.tensor([payload.numel()], dtype=torch.int64).view(torch.uint8)
        padded[8:8 + payload.numel()] = payload
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        self._wait(lambda: self.group.allgather([gathered], [padded]))
        values = []
        for buffer in gathered:
            length = int(buffer[:8].view(torch.int64).item())
            values.append(json.loads(bytes(buffer[8:8 + length].tolist()).decode()))
        return values

    def close(self, clean: bool = True) -> None:
        """Take the host group down. `clean`: the end of a run that every replica reached, so
        wait for all first. (Left to the interpreter's exit, a replica of a CI rehearsal once
        aborted after finishing: "terminate called without an active exception".) Not clean:
        this replica failed; its peers' next collective fails at once instead of waiting out
        parallel.host_timeout_s (a replica thread's failure does not end its process, so
        nothing else would close its sockets)."""
        if self.group is None:
            return
        try:
            if clean:
                self.barrier()
        finally:
            self.group.shutdown()
            if self.device_reduction == "torch":
                import torch.distributed as dist

                dist.destroy_process_group()
            self.group = self._stores = None

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

        flat = torch.cat([at_least_fp32(t.reshape(-1)) for t in tensors])
        if self.device_reduction == "torch":  # on the device, no host round trip
            self._wait(lambda: dist.all_reduce(flat, dist.ReduceOp.SUM, async_op=True))
        else:
            import torch_xla

            torch_xla.sync()  # materialise before the transfer; one graph, the same every step
            host = flat.cpu()
            self._all_reduce(host, dist.ReduceOp.SUM)
            flat = host.to(tensors[0].device)
        out, offset = [], 0
        for t in tensors:
            out.append(flat[offset:offset + t.numel()].reshape(t.shape).to(t.dtype))
            offset += t.numel()
        return out
