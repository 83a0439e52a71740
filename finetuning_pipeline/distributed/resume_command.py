"""The command that resumes a stopped run, as a user pastes it: the run's own command with
`--resume auto`, its device environment, and the launcher that started it.

A run started as one process resumes as `python main.py ...`. One of torchrun's processes reads
the command line of its parent, torchrun's agent (/proc/PID/cmdline on Linux, the TPU VM's and the
GPU machine's system), and keeps it up to main.py: `torchrun --nproc-per-node N ...` as the user
typed it, its process count and rendezvous included, so the resumed run has the global batch the
checkpoint was saved with. Where that command cannot be read, torchrun's environment gives one
(`torch.distributed.run --standalone --nproc-per-node LOCAL_WORLD_SIZE`, with the node count and
this node's rank on several). Processes of the torchrun agent main.py runs itself (`main.py
--nproc-per-node N`, TorchTPU on a TPU host: distributed/torchrun_agent.py) resume as main.py's
command, which runs the agent again.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from finetuning_pipeline.distributed.collectives import torchrun_world

# Set by main.py where it runs torchrun's agent itself (distributed/torchrun_agent.py): the user's
# command is then main.py's, not torchrun's.
BECAME_TORCHRUN = "TPU_LORA_BECAME_TORCHRUN"


def resume_command(script: Path, arguments: list[str], device_environment: tuple[str, ...], environ=None,
                   parent_command: list[str] | None = None) -> str:
    """`script` (main.py) with `arguments` (its --resume auto among them), prefixed by the
    variables of `device_environment` set in `environ` and by the launcher that started this
    process. parent_command: torchrun's command line (default: read from /proc)."""
    environ = os.environ if environ is None else environ
    environment = [f"{name}={shlex.quote(environ[name])}" for name in device_environment if name in environ]
    launcher = [sys.executable]
    if torchrun_world() > 1 and not environ.get(BECAME_TORCHRUN):
        command = parent_command if parent_command is not None else agent_command()
        launcher = torchrun_prefix(command, script) or torchrun_from_environment(environ)
    return " ".join([*environment, shlex.join([*launcher, os.path.relpath(script), *arguments])])


def agent_command() -> list[str] | None:
    """The command line of this process's parent (torchrun's agent), or None where it cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def torchrun_prefix(command: list[str] | None, script: Path) -> list[str] | None:
    """`command` up to the script it runs (main.py, however it was named: a relative path, a path
    from another directory), or None when it runs no such script (not torchrun's agent of this run)."""
    if not command:
        return None
    for index, part in enumerate(command):
        if part.endswith(".py") and Path(part).name == script.name and index > 0:
            runs_torchrun = any("torch.distributed.run" in p or Path(p).name == "torchrun" for p in command[:index])
            return command[:index] if runs_torchrun else None
    return None


def torchrun_launcher(rendezvous: list[str], per_node: int | str) -> list[str]:
    """torchrun as this interpreter runs it (`python -m torch.distributed.run`), with its rendezvous
    arguments and a process per device of this node; the script and its arguments follow."""
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(per_node)]


def torchrun_from_environment(environ) -> list[str]:
    """torchrun's command rebuilt from the environment it gives its processes (LOCAL_WORLD_SIZE;
    on several nodes GROUP_WORLD_SIZE, GROUP_RANK and MASTER_ADDR:MASTER_PORT)."""
    per_node = environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", "1"))
    nodes = int(environ.get("GROUP_WORLD_SIZE", "1"))
    if nodes <= 1:
        rendezvous = ["--standalone"]
    else:
        rendezvous = ["--nnodes", str(nodes), "--node-rank", environ.get("GROUP_RANK", "0"),
                      "--rdzv-backend", "c10d", "--rdzv-endpoint",
                      f"{environ.get('MASTER_ADDR', 'localhost')}:{environ.get('MASTER_PORT', '29400')}"]
    return torchrun_launcher(rendezvous, per_node)
