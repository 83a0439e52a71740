"""How replicas talk: the one module that knows.

Two kinds of traffic:
- Host decisions every replica must take together (stop at this step, the checkpoint was
  written, wait here) go through a gloo group on the host: a vote is one small TCP round trip
  and never touches the device. Each replica has a group object of its own, not
  torch.distributed's process-wide default group: on TPU v2/v3 a process runs two replicas
  as threads (runtime/xla/launch.py), and one default group per process cannot hold both ranks. (torch_xla 2.9's
  `xm.rendezvous`/`xm.mesh_reduce` all-gather on the device and sync the graph first:
  `xla_model.xla_rendezvous`, a host sync per vote.) A peer that dies closes its sockets, so a
  vote fails at once on the others instead of hanging.
- Device sums (gradients, loss and token counts, eval sums): each runtime's own, handed to
  Collectives as its `device_sum` (runtime/xla/device_sum.py: an XLA all-reduce inside the
  step's graph, or through gloo via host memory where XLA:CPU has none across processes;
  runtime/native/device_sum.py: torch.distributed's default group on the device's backend).
  None: nothing to sum (one process, or one SPMD program whose partitioner inserts the sums).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Protocol

import torch

from finetuning_pipeline.errors import ReplicaLost
from utils.precision import at_least_fp32


def torchrun_world() -> int:
    """The number of processes `torchrun` started (1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "TORCHELASTIC_RUN_ID" in os.environ else 1


def launch_rank() -> int:
    """This process's rank among the processes torchrun started (0 when not under torchrun)."""
    return int(os.environ.get("RANK", "0")) if torchrun_world() > 1 else 0


def replica_group(init_method: str, rank: int, world: int, timeout_s: float = 1800):
    """This replica's gloo group. `init_method` "env://" reads torchrun's environment
    (MASTER_ADDR, RANK, ...); another is the rendezvous its runtime registered (torch_xla's
    "xla://" finds a TPU pod's master host: runtime/xla/replicas.py). Returns (group, stores);
    keep the stores alive as long as the group."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous(init_method, timeout=timeout))
    client = store
    if isinstance(store, dist.TCPStore):
        # A client of its own: torch_xla hands every thread of a process the same store, and
        # two replica threads waiting on one socket block each other in gloo's rendezvous
        # (measured: the second group never connects).
        client = dist.TCPStore(store.host, store.port, is_master=False, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore("tpu-lora/replicas", client), rank, world, timeout)
    return group, (store, client)  # rank 0's store is the server the others connect to


class DeviceSum(Protocol):
    """How a runtime sums device tensors over the replicas of a Collectives."""

    def sum(self, collectives: "Collectives", tensors: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def close(self) -> None: ...


class Collectives:
    """rank, world: this process among the processes that feed data. group, stores: their gloo
    group on the host (replica_group). device_sum: how device tensors are summed across them
    (the runtime's; None: nothing to sum)."""

    def __init__(self, rank: int = 0, world: int = 1, group=None, stores=None,
                 device_sum: DeviceSum | None = None) -> None:
        if world > 1 and group is None:
            raise ValueError("several replicas need a host group (replica_group)")
        self.rank = rank
        self.world = world
        self.device_sum = device_sum if world > 1 else None
        self.group, self._stores = group, stores  # the stores must outlive the group

    # -- host decisions -----------------------------------------------------------------------
    def _host_max(self, value: int) -> int:
        if self.world == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64)
        self.all_reduce_host(tensor, dist.ReduceOp.MAX)
        return int(tensor.item())  # a host tensor: no device sync

    def all_reduce_host(self, host_tensor: torch.Tensor, op) -> None:
        """Reduce a host tensor in place over the replicas, through the gloo group."""
        import torch.distributed as dist

        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.wait_for(lambda: self.group.allreduce([host_tensor], options))

    def wait_for(self, collective) -> None:
        """Start a collective and wait for it; a replica gone meanwhile is ReplicaLost."""
        try:
            collective().wait()
        except RuntimeError as err:  # gloo: "Connection closed by peer", a timeout, ...
            raise ReplicaLost.of(self.rank, "", err) from None

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
        self.wait_for(lambda: self.group.allgather([gathered], [padded]))
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
            if self.device_sum is not None:
                self.device_sum.close()
            self.group = self._stores = None

    # -- device sums --------------------------------------------------------------------------
    def sum_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor summed over the replicas (same shapes on every replica); returns the sums
        (the same tensors, reduced in place, where the runtime reduces in place)."""
        if self.device_sum is None:
            return tensors
        return self.device_sum.sum(self, tensors)


def summed_flat(tensors: list[torch.Tensor], reduce_flat) -> list[torch.Tensor]:
    """The tensors concatenated into one flat tensor (at least fp32), reduced by
    reduce_flat(flat) -> flat in one collective, and cut back into their shapes and dtypes."""
    flat = reduce_flat(torch.cat([at_least_fp32(t.reshape(-1)) for t in tensors]))
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].reshape(t.shape).to(t.dtype))
        offset += t.numel()
    return out
