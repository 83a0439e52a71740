"""`make tpu-check` on a pod: which host this is, and the hosts' one barrier.

On a pod the user runs the same command on every host (`gcloud ... ssh --worker=all`), and
each of the check's runs is one run of the whole slice: every host's main.py joins it. So each
host's check must take the same runs in the same order, in one directory they all see
(output_dir is shared on a pod: host_agreement.py), while what each host reads alone (the check
model, its data, its run configs, its log) stays in a directory of its own: no two hosts ever
write the same file. Host 0 is the one writer of what is shared: it claims and clears the
runs' directory and writes tpu_check.json.

The barrier, at three points (every host has loaded the config, before host 0 deletes anything;
host 0 has claimed the directory, before any host writes into it; every host has written its own
model and data, before the first run): each host says it is ready or why it is not, and none goes
on before all have said. A host that failed then ends every host's check at once, with its
reason, instead of leaving the others to wait in their first run's rendezvous until its timeout. It goes through a
TCP store served by host 0's check (torch.distributed, no device), on the port the runs'
rendezvous would take; each run then gets a port of its own above it, so that a host that
starts run k+1 while another is still leaving run k cannot reach run k's store.

Which host: on a TPU VM, torch_xla's worker id and the workers' addresses (the VM's metadata);
in the CPU rehearsal of a pod, torchrun's environment, one process standing for each host.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

from finetuning_pipeline.distributed.collectives import launch_rank, torchrun_world

RENDEZVOUS_PORT = 12355  # torch_xla's xla:// rendezvous port when MASTER_PORT is unset
READY_TIMEOUT_S = 900.0  # set-up on every host: a full-width model written, data prepared


class PodCheckError(RuntimeError):
    """Another host could not take part in the check (its reason), or never came."""


@dataclass(frozen=True)
class PodHost:
    index: int  # 0 writes what the hosts share
    hosts: int
    master_addr: str  # where host 0's check serves the barrier
    port: int  # the barrier's; run k of the check rendezvous on port + 1 + k

    @property
    def writer(self) -> bool:
        return self.index == 0

    def run_environment(self, run: int) -> dict[str, str]:
        """The environment of the check's run number `run` (0, 1, ... in the order every host
        takes them): a rendezvous port of its own."""
        return {"MASTER_PORT": str(self.port + 1 + run)} if self.hosts > 1 else {}


ONE_HOST = PodHost(0, 1, "127.0.0.1", RENDEZVOUS_PORT)


def pod_host(device: str) -> PodHost:
    """This host of the slice (a single host: index 0 of 1)."""
    port = int(os.environ.get("MASTER_PORT", RENDEZVOUS_PORT))
    if torchrun_world() > 1:
        return PodHost(launch_rank(), torchrun_world(), os.environ.get("MASTER_ADDR", "127.0.0.1"), port)
    if device == "TPU":
        from torch_xla._internal import tpu

        addresses = tpu.get_worker_ips()  # in worker order; ["localhost"] on a single host
        if len(addresses) > 1:
            return PodHost(tpu.worker_id(), len(addresses), addresses[0], port)
    return ONE_HOST


class HostBarrier:
    """Every host of `host` says ready, or why not, and learns the others' word. A single host
    has nothing to wait for. Host 0 serves the store, so it lives as long as host 0's check."""

    def __init__(self, host: PodHost, timeout_s: float = READY_TIMEOUT_S) -> None:
        self.host, self.timeout_s, self.store = host, timeout_s, None
        if host.hosts > 1:
            import torch.distributed as dist

            try:
                self.store = dist.TCPStore(host.master_addr, host.port, host.hosts, is_master=host.writer,
                                           timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
            except (RuntimeError, OSError) as err:  # a client that found no server within the timeout
                raise PodCheckError(f"host {host.index}: host 0's check at {host.master_addr}:{host.port} did "
                                    f"not answer within {timeout_s:.0f} s ({err}); run the same make tpu-check "
                                    "on every host of the slice at once") from None

    def ready(self, step: str, failure: str | None = None, timeout_s: float | None = None) -> list[str]:
        """This host finished `step`, or failed it (`failure`: why); once every host has said
        which, returns the failures ("host N: why", this host's own among them; none: every host
        is ready). Raises PodCheckError when a host never came within `timeout_s` (the barrier's
        own by default), or host 0's check ended."""
        if self.store is None:
            return [failure] if failure else []
        try:
            self.store.set(f"{step}/{self.host.index}", failure or "")
            words = self._wait(step, timeout_s or self.timeout_s)
            # Host 0 serves the store: it leaves only once every host has read every word.
            self.store.set(f"{step}/read/{self.host.index}", "")
            if self.host.writer:
                self._wait(f"{step}/read", self.timeout_s)
        except RuntimeError as err:  # the store's connection: host 0's check ended
            raise PodCheckError(f"host 0's check ended during the {step} ({err}); its output says why") from None
        return [f"host {index}: {why}" for index, why in enumerate(words) if why]

    def _wait(self, prefix: str, timeout_s: float) -> list[str]:
        """Every host's value under `prefix`, once all are there."""
        keys = [f"{prefix}/{index}" for index in range(self.host.hosts)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                missing = [str(index) for index, key in enumerate(keys) if not self.store.check([key])]
                raise PodCheckError(f"host {', '.join(missing)} did not reach the check's {prefix} within "
                                    f"{timeout_s:.0f} s; run the same make tpu-check on every host at once "
                                    "(the output of the host that did not come says why)")
            time.sleep(0.2)
        return [self.store.get(key).decode() for key in keys]
