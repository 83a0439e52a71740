"""Where every thread of a trainer process is, for a run that seems hung or that crashed.

- `kill -USR1 PID`: the process prints each of its threads' Python stacks to its stderr and
  carries on. Every process of a run takes it: the command itself, each worker process the TPU
  launcher starts, each torchrun replica. The handler runs on the process's main thread, under
  the interpreter lock, so it can stop nothing it interrupts; it runs as soon as the main
  thread is in Python or in an interruptible wait (a lock, a join: where the launcher's and its
  workers' main threads wait), not while the main thread itself is stuck in C (a replica on
  the main thread blocked in gloo: use the next one there).
- A fatal signal (a segfault in XLA, SIGABRT, `kill -ABRT PID`) prints every thread's stack
  before the process dies (faulthandler, written from C, so it works whatever the threads do;
  it reads the other threads' frames without the lock, which is safe only because the process
  ends anyway: done on a live one, as an earlier version did on SIGUSR1, it once killed a
  worker that was busy importing).
"""

from __future__ import annotations

import faulthandler
import io
import signal
import sys
import threading

DUMP_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal() -> None:
    """On the process's main thread: DUMP_SIGNAL prints the threads' stacks, a fatal signal too."""
    stream = sys.__stderr__  # the process's own fd 2, also where a test captures sys.stderr
    try:
        stream.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return  # no stderr to write to (a daemon without one): nothing would be seen
    if not faulthandler.is_enabled():  # (pytest enables its own)
        faulthandler.enable(file=stream, all_threads=True)
    if threading.current_thread() is not threading.main_thread():
        return  # only a main thread installs signal handlers (its process's owner does)
    signal.signal(DUMP_SIGNAL, lambda signum, frame: print(thread_stacks(frame), file=stream, flush=True))


def thread_stacks(interrupted=None) -> str:
    """Every thread's stack, most recent call first (faulthandler's layout); `interrupted`: the
    main thread's frame where a signal handler interrupted it (not the handler's own)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.main_thread().ident and interrupted is not None:
            frame = interrupted
        lines = [f"Thread {ident:#x} ({names.get(ident, '?')}) (most recent call first):"]
        while frame is not None:
            lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno} in {frame.f_code.co_name}')
            frame = frame.f_back
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"
