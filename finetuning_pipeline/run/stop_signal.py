"""Stopping on request: SIGTERM (a spot VM's preemption notice, `kill`) or SIGINT (Ctrl-C).

A signal only sets a flag in the process that received it. At every step boundary the
replicas vote on their flags (a host collective, no device sync: collectives.py), so when any
replica was signalled, all of them stop after the same step, checkpoint it together, and exit
0; the same command then resumes. A preempted VM signals every process; a stray `kill` of one
worker stops the whole run the same way instead of leaving the others waiting for it.

Python runs signal handlers on a process's main thread only, and only the main thread can
install them. A TPU host runs its replicas on worker threads (launch.py, as torch_xla.launch
does), so the handlers are installed per process, by whoever owns its main thread: the
launcher in each worker process before it starts the replica threads, `StopOnSignal` when the
replica itself runs on the main thread (the XLA runtime's one process, torchrun, fsdp), or
`on_a_thread_leaving_signals_here` for the native runtime's process. Every replica of the
process reads the same flag.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from utils.stack_dump import DUMP_SIGNAL

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ProcessSignals:
    """This process's stop flag: SIGTERM/SIGINT set it instead of killing the process. A second
    signal is not special: use SIGKILL to stop at once (the next start resumes from the last
    complete checkpoint)."""

    def __init__(self) -> None:
        # A plain flag, not a threading.Event: a second signal can interrupt the handler on the same
        # thread, and Event.set's lock, held by the first, then never comes free (a CI run hung so,
        # SIGTERM to the launcher and its worker at once). Assignments take no lock.
        self.stop_requested = False
        self.received: str | None = None
        self.signals_received: list[int] = []  # in order: what a launcher passes on (distributed/stop_relay.py)
        self._previous: dict = {}
        self._watches: list = []  # (condition, reason): see watch_parent

    def install(self) -> bool:
        """On the main thread: catch the stop signals until `restore()`. Returns whether this call
        installed them: where an earlier step of the process's start-up did (main.py's first
        lines), they stay as they are, and so does a stop they already took."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("stop signal handlers can only be installed on a process's main thread; start the "
                               "replicas with finetuning_pipeline.runtime.xla.launch, which installs them per process")
        if self._previous:
            return False
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self.handle)
        return True

    @contextlib.contextmanager
    def caught(self):
        """Within the block, on the main thread, the stop signals set this flag (installed here
        unless they already are; restored by whoever installed them). On another thread: nothing,
        as a replica's StopOnSignal there asks that the process's main thread catch them."""
        owner = threading.current_thread() is threading.main_thread() and self.install()
        try:
            yield self
        finally:
            if owner:
                self.restore()

    def handle(self, signum, frame) -> None:
        self.signals_received.append(signum)
        self.request(signal.Signals(signum).name)

    def request(self, reason: str) -> None:
        """Stop as a signal would."""
        self.received = reason
        self.stop_requested = True

    def watch(self, condition, reason: str) -> None:
        """Stop for `reason` once condition() is true, as asked at each step (`poll`)."""
        self._watches.append((condition, reason))

    def poll(self) -> bool:
        """Whether to stop: a signal received, or a watched condition now true (which then names the stop)."""
        if not self.stop_requested:
            for condition, reason in self._watches:
                if condition():
                    self.request(reason)
                    break
        return self.stop_requested

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def restore(self) -> None:
        """The handlers as before `install()`; what they took ends with them (a later run of the
        same process, a test's, starts unstopped)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self._watches.clear()
        self.stop_requested = False
        self.received = None
        self.signals_received = []


# One per process: every replica thread of a process shares it (and its signals).
PROCESS_SIGNALS = ProcessSignals()


@contextlib.contextmanager
def threads_started_here_leave_signals_to_this_one():
    """On a main thread that handles the process's signals: every thread started inside the
    block (and every thread those start: XLA's, gloo's, the replicas') blocks them, so the
    kernel hands a SIGTERM, SIGINT or SIGUSR1 sent to the process to this thread alone. The
    handlers run on the main thread whichever thread took a signal, but a C++ runtime thread that
    takes one has its system call interrupted (EINTR): SIGTERM sent to a worker's threads one by
    one aborted it with a corrupted heap in 1 run of 17 here and once in CI, and SIGINT sent to
    every thread for 1.5 s in 3 runs of 6 (0 of 6 with the mask)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, (*SIGNALS, DUMP_SIGNAL))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def on_a_thread_leaving_signals_here(fn, *args) -> None:
    """fn(*args) on a worker thread whose threads, and theirs (gloo's, autograd's, a GPU's), block
    the stop signals, while this main thread catches them (PROCESS_SIGNALS) and waits: how a
    process that is one replica (the native runtime's, alone or one of torchrun's) keeps a
    signal that reaches one of its C++ threads from interrupting that thread's system call (see
    threads_started_here_leave_signals_to_this_one). What fn raises is raised here."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as err:
            failure.append(err)

    with PROCESS_SIGNALS.caught():
        with threads_started_here_leave_signals_to_this_one():
            thread = threading.Thread(target=run, name="replica")
            thread.start()
        while thread.is_alive():
            thread.join(0.5)  # (short waits: a signal's handler runs between them)
    if failure:
        raise failure[0]


def watch_parent(parent: int, signals: ProcessSignals, reason: str) -> None:
    """When the process that started this one (`parent`: the TPU launcher, torchrun's agent) dies
    without passing a signal on (SIGKILL, the out-of-memory killer, a closed terminal's SIGHUP to
    it alone), this process is re-parented: its replicas then stop as on SIGTERM, checkpoint and
    exit, instead of training on unwatched and holding the devices from the next run. Asked at
    each step (a getppid, no wait) and again when the master names the stop: torchrun's processes
    are re-parented at once, so one that voted to stop on another's word still names the cause
    (a watching thread, asked once a second, left it saying "another replica's request")."""
    signals.watch(lambda: os.getppid() != parent, reason)


class StopOnSignal:
    """One replica's reasons to stop: within the `with` block, a stop signal to its process
    (PROCESS_SIGNALS), or `budget` (train.max_wall_time) running out. On the main thread it
    installs the process's handlers itself; on a worker thread they must be installed already
    (launch.py does), or it refuses to start: a replica that cannot be stopped cleanly would
    lose everything since its last checkpoint at a preemption."""

    def __init__(self, budget: "WallClockBudget | None" = None, signals: ProcessSignals = PROCESS_SIGNALS) -> None:
        self.signals = signals
        self.budget = budget
        self._owner = False

    def requested(self) -> bool:
        """Asked once per step (StopVote)."""
        return self.signals.poll() or (self.budget is not None and self.budget.exhausted())

    @property
    def received(self) -> str | None:
        self.signals.poll()  # (a replica that stopped on another's vote may see the cause now)
        return self.signals.received

    def reason(self) -> str:
        if self.received:
            return self.received
        if self.budget is not None and self.budget.hit:
            return f"the session budget (train.max_wall_time={self.budget.label})"
        return "another replica's request"

    def after_stop(self, step: int, phase: int, resume_command: str) -> str:
        """What the master prints once every replica has stopped and the checkpoint is written."""
        if not self.received and self.budget is not None and self.budget.hit:
            return (f"stopped before {self.reason()} ran out, after a checkpoint at step {step} of phase {phase}; "
                    f"the next session continues with the same command:\n  {resume_command}")
        return (f"stopped on {self.reason()} after a checkpoint at step {step} of phase {phase}; resume with:\n"
                f"  {resume_command}")

    def signalled(self) -> bool:
        """A stop signal alone (or a watched parent's exit), without the session budget: asked
        before a phase's first step, where the budget is left to the steps (a session trains at
        least one step)."""
        return self.signals.poll()

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._owner = self.signals.install()  # (or kept as main.py's start-up installed them)
        elif not self.signals.installed:
            raise RuntimeError(
                "this replica runs on a worker thread and its process catches no stop signal: a "
                "preemption would kill it without a checkpoint. Start replicas with "
                "finetuning_pipeline.runtime.xla.launch (it installs the handlers on each process's main thread)"
            )
        return self

    def __exit__(self, *exc) -> None:
        if self._owner:
            self.signals.restore()
            self._owner = False


def stopped_before_step(reason: str, step: int, phase: int, resume_command: str) -> str:
    """What the master prints when a stop came during the start of a phase, before its first
    step here: `step` is where the phase starts (0, or its checkpoint's step, which stays the
    newest). A stop during start-up trains nothing and writes no checkpoint."""
    if step:
        return (f"stopped on {reason} before step {step + 1} of phase {phase}, nothing trained since its checkpoint "
                f"at step {step}; resume with:\n  {resume_command}")
    return (f"stopped on {reason} before the first step of phase {phase}: nothing of it was trained and no checkpoint "
            f"written; the same command starts it:\n  {resume_command}")


def stopped_before_processes(reason: str, processes: int, command: str) -> str:
    """What main.py running torchrun's agent prints for a stop taken before it started the processes."""
    return (f"stopped on {reason} before the run's {processes} processes were started: nothing was trained or "
            f"written; the same command starts it:\n  {command}")


class StopVote:
    """`due()` is True on every replica once any replica's stop flag is set: every step, so a
    30-second preemption notice is honoured within one step, however long `logging.every` is."""

    def __init__(self, collectives, requested=lambda: False) -> None:
        self.collectives = collectives
        self.requested = requested

    def due(self) -> bool:
        return self.collectives.any(self.requested())


class WallClockBudget:
    """train.max_wall_time: a session that ends without a signal (Kaggle's 9 hours, Colab's
    less). `exhausted()` is asked once per step; it is True once the time left is less than
    twice the slowest interval between two asks so far (a step, plus an evaluation or a
    checkpoint when one fell in between), so the stop's checkpoint is written before the
    budget runs out. The clock runs from the start of the process."""

    def __init__(self, seconds: float | None, started: float, clock=time.time, label: str = "") -> None:
        self.seconds = seconds
        self.label = label  # the budget as configured, for messages
        self.started = started
        self.clock = clock
        self.slowest = 0.0
        self.hit = False
        self._last: float | None = None

    def exhausted(self) -> bool:
        if self.seconds is None:
            return False
        now = self.clock()
        if self._last is not None:
            self.slowest = max(self.slowest, now - self._last)
        self._last = now
        self.hit = self.hit or now - self.started + 2 * self.slowest >= self.seconds
        return self.hit
