"""A stop signal while a command writes: unwind, so that what it staged is removed, then one line.

By default SIGTERM (`kill`, a spot VM's preemption notice, a job scheduler) ends a Python process
at once: no `finally` runs, so a half-written output staged next to its destination (output_guard's
`.NAME.partial-PID`) would stay on disk, gigabytes for a 7B export. While an output is staged,
SIGTERM raises `Interrupted` instead, as SIGINT (Ctrl-C) raises KeyboardInterrupt, so the staging
blocks' cleanup runs; the command then reports it in one line (`report_interrupted`) and exits
128 + the signal's number, as a shell reports a process killed by it.

Only a signal whose handler would have ended the process is taken over: the trainer's own handlers
(run/stop_signal.py: a SIGTERM there means "checkpoint, then stop") are left as they are, and so is
a worker thread, where Python cannot install handlers (the trainer's replicas write from those).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT received while an output was being written."""

    def __init__(self, signum: int) -> None:
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(self.signal_name)


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_signals_unwind() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT raise `Interrupted` where they would otherwise have
    ended the process (their default handlers); nested blocks and other handlers are left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            previous[sig] = signal.signal(sig, _raise_interrupted)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def report_interrupted(err: KeyboardInterrupt, command: str) -> int:
    """Print the one line a command gives when a stop signal ended it; returns its exit status
    (128 + the signal's number, as a shell reports a process the signal killed)."""
    name = getattr(err, "signal_name", "SIGINT")
    print(f"error: {command}: stopped by {name}; nothing half-written was left (what it had staged was removed). "
          "Run the same command again to write the output", file=sys.stderr, flush=True)
    return getattr(err, "exit_code", 128 + signal.SIGINT)
