"""How the XLA runtime sums device tensors over its replicas (distributed/collectives.py's DeviceSum).

- `XlaAllReduce`: `xm.all_reduce` inside the step's graph (one process per TPU chip).
- `HostRoundTrip`: through gloo via host memory: processes started by `torchrun` on a CPU, and the
  TPU launcher's threads on a CPU, where XLA:CPU has no cross-process or cross-thread collectives
  (pytorch/xla#5342). This costs a sync and a transfer per step: it exists so the multi-process
  control flow runs on a CPU exactly as on a pod, not for speed.
"""

from __future__ import annotations

import torch

from finetuning_pipeline.distributed.collectives import Collectives, summed_flat


class XlaAllReduce:
    def sum(self, collectives: Collectives, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch_xla.core.xla_model as xm

        xm.all_reduce(xm.REDUCE_SUM, tensors)  # a list is reduced in place, in one collective
        return tensors

    def close(self) -> None:
        pass


class HostRoundTrip:
    def sum(self, collectives: Collectives, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch.distributed as dist
        import torch_xla

        def through_host(flat: torch.Tensor) -> torch.Tensor:
            torch_xla.sync()  # materialise before the transfer; one graph, the same every step
            host = flat.cpu()
            collectives.all_reduce_host(host, dist.ReduceOp.SUM)
            return host.to(flat.device)

        return summed_flat(tensors, through_host)

    def close(self) -> None:
        pass
