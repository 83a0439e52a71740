"""The errors a user can hit, and the one place they become exit codes.

    2  bad input: a config key, a data directory, a model or adapter that does not fit
       (ConfigError, DataError, ModelLoadError, HubModelError), an output that would overwrite an input or
       what the command did not write (OutputConflict); nothing was trained or written.
    3  the run had to stop (RunError): a recompile after warm-up, diverged training, a failed
       checkpoint write, a replica that died. What is on disk is intact; the message says
       what to do, usually: fix it and rerun with --resume auto.

Every command (`main.py`, `evaluate`, `generate`, `export`) runs through `exit_code_of`, so
a user sees `error: <what, where, what to do>` and never a traceback for these.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from dataset.errors import DataError
from utils.hub_models import HubModelError
from utils.interrupts import report_interrupted, stop_signals_unwind
from utils.output_guard import OutputConflict
from utils.tokenizer_loading import TokenizerError


class ConfigError(ValueError):
    """A bad configuration; the message names the key (and the file) and says what to do."""


class ModelLoadError(ValueError):
    """A model or adapter directory that is missing, unreadable, or does not fit the model."""


class RunError(RuntimeError):
    """The run had to stop; the message says why and what to do."""


class RecompileError(RunError):
    pass


class TrainingDiverged(RunError):
    pass


class CheckpointWriteError(RunError):
    pass


class OutputWriteError(RunError):
    """A file of the running phase could not be written (metrics, adapter, summary: a full or
    read-only disk) or read (a data shard gone or unreadable mid-run)."""


class ReplicaLost(RunError):
    """A host collective failed: another replica died, or stopped answering."""

    @classmethod
    def of(cls, rank: int, where: str, err: BaseException) -> "ReplicaLost":
        """The one line a replica says when a collective failed because a peer is gone: its rank,
        where, and the backend's own first line (gloo's and NCCL's messages run on for lines of
        their C++ call sites)."""
        said = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        return cls(f"replica {rank}: another replica stopped answering{where} ({said[:300]}); the run resumes "
                   "from its last complete checkpoint with --resume auto")


BAD_INPUT = (ConfigError, DataError, ModelLoadError, OutputConflict, TokenizerError, HubModelError)


def exit_code_of(err: BaseException) -> int | None:
    """2 for bad input, 3 for a run that had to stop, None for anything else (a bug: let the
    traceback show)."""
    if isinstance(err, BAD_INPUT):
        return 2
    if isinstance(err, RunError):
        return 3
    return None


def run_command(main, *args, own_stop_signals: bool = False) -> int:
    """Call `main(*args)`; an error of ours is printed as one line on stderr and becomes its exit
    code. So does a file-system error (a full or read-only disk, a permission): exit 3, naming
    the file; every command writes its outputs atomically, so nothing half-written is left. A stop
    signal is one line too (utils/interrupts.py), exit 128 + its number: SIGTERM unwinds the
    command as SIGINT does, unless it handles the stop signals itself (own_stop_signals: the
    trainer, whose SIGTERM checkpoints and stops, and whose launcher forwards it to its workers)."""
    try:
        with contextlib.nullcontext() if own_stop_signals else stop_signals_unwind():
            return main(*args)
    except (*BAD_INPUT, RunError) as err:
        say_error(f"error: {err}")
        return exit_code_of(err)
    except KeyboardInterrupt as err:  # SIGINT, or SIGTERM (utils/interrupts.py): what was staged is removed
        return report_interrupted(err, command_name(main))
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        say_error(f"error: {where}{err.strerror or err}; nothing half-written was left. Fix it (free space, "
                  "permissions) and run the same command again")
        return 3


# How a replica's error that only follows from the master's ends (the master's names the cause):
# where the master's own line is there, main.py's torchrun agent says that one alone.
SEE_THE_MASTERS = "(see the master's error)"

# Set by main.py for the processes of the torchrun agent it runs itself (distributed/torchrun_agent.py).
ERRORS_TO_AGENT = "TPU_LORA_ERRORS_TO_AGENT"


def say_error(line: str) -> None:
    """`line` on stderr; in a process of main.py's own torchrun agent, in the error file torchrun
    gave it (TORCHELASTIC_ERROR_FILE, in the form its ProcessFailure reads), from which the agent
    says each process's line once: a refusal every process made is one line, not one a process."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE") if os.environ.get(ERRORS_TO_AGENT) else None
    if error_file:
        Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
        return
    print(line, file=sys.stderr, flush=True)


def command_name(main) -> str:
    """How a user knows the command `main` runs: its module's last name (export, generate, main),
    also when it runs as __main__ (`python -m finetuning_pipeline.export`, `python .../main.py`)."""
    module = sys.modules.get(main.__module__)
    spec = getattr(module, "__spec__", None)
    if spec is not None:
        return spec.name.rpartition(".")[2]
    return Path(getattr(module, "__file__", None) or main.__module__).stem
