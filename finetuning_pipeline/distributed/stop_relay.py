"""A stop signal taken by a process that started the run's processes (main.py running torchrun's
agent, the TPU launcher) is passed on to each of them once that process catches it.

Passed on as it arrives, a stop is lost or does harm during start-up: a process not started yet
never hears of it (the run then trained every step), one still importing torch is killed by
SIGTERM's default action or interrupted by SIGINT's KeyboardInterrupt in the middle of an import
(a traceback a process). So the launching process keeps the signals it took (PROCESS_SIGNALS,
caught from main.py's first lines) and, each time its main thread wakes, sends each of its
processes those not yet sent to it, once the kernel says that process catches SIGTERM
(/proc/PID/status, SigCgt: main.py's handlers are installed, SIGINT's with it). The process then
stops at the next place its replicas vote: before a phase's first step, or after a step.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

from finetuning_pipeline.run.stop_signal import PROCESS_SIGNALS, ProcessSignals


class StopRelay:
    """`pass_on()`: each signal `signals` took, sent (as `translate` says) once to each of
    `processes()` that catches the stop signals; asked by the launching thread as it waits."""

    def __init__(self, processes: Callable[[], list[int]], signals: ProcessSignals = PROCESS_SIGNALS,
                 translate: Callable[[int], int] = lambda signum: signum) -> None:
        self.processes = processes
        self.signals = signals
        self.translate = translate
        self.sent: dict[int, int] = {}  # pid -> how many of the signals taken it was sent

    def pass_on(self) -> None:
        taken = list(self.signals.signals_received)
        if not taken:
            return
        for pid in self.processes():
            done = self.sent.get(pid, 0)
            if done < len(taken) and catches_stop_signals(pid):
                for signum in taken[done:]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, self.translate(signum))
                self.sent[pid] = len(taken)


def catches_stop_signals(pid: int) -> bool:
    """Whether process `pid` has a handler of its own for SIGTERM (the Linux kernel's SigCgt mask;
    the TPU VM's and the GPU machine's system). A process that has exited does not."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False
