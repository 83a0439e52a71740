"""The errors a user can hit, and the one place they become exit codes.

    2  bad input: a config key, a data directory, a model or adapter that does not fit
       (ConfigError, DataError, ModelLoadError); nothing was trained or written.
    3  the run had to stop (RunError): a recompile after warm-up, diverged training, a failed
       checkpoint write, a replica that died. What is on disk is intact; the message says
       what to do, usually: fix it and rerun with --resume auto.

Every command (`main.py`, `evaluate`, `generate`, `export`) runs through `exit_code_of`, so
a user sees `error: <what, where, what to do>` and never a traceback for these.
"""

from __future__ import annotations

import sys

from dataset.errors import DataError


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


class ReplicaLost(RunError):
    """A host collective failed: another replica died, or stopped answering."""


BAD_INPUT = (ConfigError, DataError, ModelLoadError)


def exit_code_of(err: BaseException) -> int | None:
    """2 for bad input, 3 for a run that had to stop, None for anything else (a bug: let the
    traceback show)."""
    if isinstance(err, BAD_INPUT):
        return 2
    if isinstance(err, RunError):
        return 3
    return None


def run_command(main, *args) -> int:
    """Call `main(*args)`; an error of ours is printed as one line on stderr and becomes its exit code."""
    try:
        return main(*args)
    except (*BAD_INPUT, RunError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return exit_code_of(err)
