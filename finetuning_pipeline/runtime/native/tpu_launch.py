"""The native runtime on a TPU host: a process per chip under torchrun, started TorchTPU's way.

TorchTPU decides in the parent, before any worker starts, what every rank must agree on: one
address per rank (TORCH_TPU_SLICEBUILDER_ADDRESSES, one per chip of every host), the slice's
topology, and on a pod each host's rank and the rendezvous (NNODES, NODE_RANK, MASTER_ADDR,
MASTER_PORT, from TPU_WORKER_HOSTNAMES). `torch.tpu.distributed.set_tpu_launch_env()` sets them
(torch_tpu 0.2.0, read from its package) and leaves the starting of the workers to a launcher.
So `main.py ... runtime.backend=native runtime.device=tpu`, run plainly, sets them and replaces
itself with torchrun over main.py and the same arguments, a process per chip of this host, as the
XLA runtime's launcher starts one per chip (runtime/xla/launch.py). On a pod the same command runs
on every host, each becoming its host's torchrun. Nothing of this has run on a TPU: the commands
it builds are tested from environments shaped as set_tpu_launch_env leaves them.
"""

from __future__ import annotations

import os

from finetuning_pipeline.distributed.resume_command import BECAME_TORCHRUN, torchrun_launcher
from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.runtime.native.device import import_torch_tpu


def torchrun_command(script: str, argv: list[str], environ) -> list[str] | None:
    """torchrun over `script` with `argv`, starting this host's processes of the slice that
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
        rendezvous = ["--standalone"]
    else:
        rendezvous = ["--nnodes", str(hosts), "--node-rank", environ["NODE_RANK"],
                      "--master-addr", environ["MASTER_ADDR"], "--master-port", environ["MASTER_PORT"]]
    return [*torchrun_launcher(rendezvous, per_host), script, *argv]


def become_torchrun_on_tpu(script: str, argv: list[str]) -> None:
    """Set TorchTPU's launch environment and replace this process with torchrun over `script`
    (its processes inherit the environment; a stop signal to torchrun reaches each of them);
    returns only when this host's slice is one chip, which this process then trains on."""
    tpu = import_torch_tpu()
    tpu.distributed.set_tpu_launch_env()
    command = torchrun_command(script, argv, os.environ)
    if command is None:
        return
    print(f"runtime.device=tpu: {command[command.index('--nproc-per-node') + 1]} processes on this host under "
          f"torchrun ({os.environ.get('NNODES', '1')} hosts)", flush=True)
    os.environ[BECAME_TORCHRUN] = "1"  # its processes resume as this command, which becomes torchrun again
    os.execv(command[0], command)
