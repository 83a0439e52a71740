"""Stopping on request: SIGTERM (a spot VM's preemption notice, `kill`) or SIGINT (Ctrl-C).

A signal only sets a flag in the process that received it. At every step boundary the
replicas vote on their flags (a host collective, no device sync: collectives.py), so when any
replica was signalled, all of them stop after the same step, checkpoint it together, and exit
0; the same command then resumes. A preempted VM signals every process; a stray `kill` of one
worker stops the whole run the same way instead of leaving the others waiting for it.
"""

from __future__ import annotations

import signal
import threading


class StopOnSignal:
    """Within the `with` block, SIGTERM/SIGINT set `event` instead of killing the process. A
    second signal is not special: use SIGKILL to stop at once (the next start resumes from
    the last complete checkpoint)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: str | None = None
        self.previous = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name
        self.event.set()

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class StopVote:
    """`due()` is True on every replica once any replica's stop flag is set: every step, so a
    30-second preemption notice is honoured within one step, however long `logging.every` is."""

    def __init__(self, collectives, requested=lambda: False) -> None:
        self.collectives = collectives
        self.requested = requested

    def due(self) -> bool:
        return self.collectives.any(self.requested())
