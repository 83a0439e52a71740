"""The native runtime on a TPU host: a process per chip under torchrun, started TorchTPU's way.

TorchTPU decides in the parent, before any worker starts, what every rank must agree on: one
address per rank (TORCH_TPU_SLICEBUILDER_ADDRESSES, one per chip of every host), the slice's
topology, and on a pod each host's rank and the rendezvous (NNODES, NODE_RANK, MASTER_ADDR,
MASTER_PORT, from TPU_WORKER_HOSTNAMES). `torch.tpu.distributed.set_tpu_launch_env()` sets them
(torch_tpu 0.2.0, read from its package) and leaves the starting of the workers to a launcher.
So `main.py ... runtime.backend=native runtime.device=tpu`, run plainly, sets them and runs
torchrun's agent over main.py and the same arguments (distributed/torchrun_agent.py), a process
per chip of this host, as the XLA runtime's launcher starts one per chip (runtime/xla/launch.py).
On a pod the same command runs on every host, each running its host's agent. Nothing of this has
run on a TPU: the arguments it builds are tested from environments shaped as set_tpu_launch_env
leaves them.
"""

from __future__ import annotations

import os

from finetuning_pipeline.distributed.torchrun_agent import run_torchrun_agent
from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.runtime.native.device import import_torch_tpu


def torchrun_arguments(environ) -> tuple[list[str], int] | None:
    """(torchrun's rendezvous arguments, the processes of this host) for the slice that
    set_tpu_launch_env described in `environ`; None when the slice is one chip (this process is it)."""
    addresses = [a for a in environ.get("TORCH_TPU_SLICEBUILDER_ADDRESSES", "").split(",") if a]
    hosts = int(environ.get("NNODES", "1"))
    if not addresses or len(addresses) % hosts:
        raise ConfigError(f"runtime.device=tpu: TorchTPU's launch environment names {len(addresses)} ranks "
                          f"(TORCH_TPU_SLICEBUILDER_ADDRESSES) for {hosts} hosts (NNODES); unset both to let "
                          "torch.tpu.distributed.set_tpu_launch_env decide them, or set them to agree")
    per_host = len(addresses) // hosts
    if hosts == 1 and per_host == 1:
        return None
    if hosts == 1:
        return ["--standalone"], per_host
    return ["--nnodes", str(hosts), "--node-rank", environ["NODE_RANK"], "--master-addr", environ["MASTER_ADDR"],
            "--master-port", environ["MASTER_PORT"]], per_host


def run_processes_on_tpu(script: str, argv: list[str]) -> int | None:
    """Set TorchTPU's launch environment and run torchrun's agent over `script` here (its processes
    inherit the environment; a stop signal to this process reaches each of them); returns the
    run's exit status, or None when this host's slice is one chip, which this process then trains on."""
    tpu = import_torch_tpu()
    tpu.distributed.set_tpu_launch_env()
    arguments = torchrun_arguments(os.environ)
    if arguments is None:
        return None
    rendezvous, per_host = arguments
    print(f"runtime.device=tpu: {per_host} processes on this host under torchrun's agent "
          f"({os.environ.get('NNODES', '1')} hosts)", flush=True)
    return run_torchrun_agent(rendezvous, per_host, script, argv)
