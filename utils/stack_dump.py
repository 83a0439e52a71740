"""`kill -USR1 PID`: every thread of that trainer process prints where it is, and carries on.

A run that seems hung (a replica waiting at a host collective, a process that does not exit
after a stop) is then diagnosed without a debugger or py-spy: every process of a run (the
command itself, each worker process the TPU launcher starts, each torchrun replica) writes the
Python stack of each of its threads to its stderr. faulthandler writes it from C, so it works
while every thread is blocked in C (gloo, XLA, a join), where a Python handler would never run.
"""

from __future__ import annotations

import faulthandler
import io
import signal
import sys

DUMP_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal() -> None:
    """From now on DUMP_SIGNAL dumps this process's threads' stacks to its stderr."""
    stream = sys.__stderr__  # the process's own fd 2, also where a test captures sys.stderr
    try:
        stream.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return  # no stderr to write to (a daemon without one): nothing would be seen
    faulthandler.register(DUMP_SIGNAL, file=stream, all_threads=True)
