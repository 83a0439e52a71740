"""torchrun's agent run by main.py itself: `main.py --nproc-per-node N ...` (and main.py on a
TPU host under TorchTPU: runtime/native/tpu_launch.py) starts N processes of the same command as
torchrun would, and answers as main.py does: one line per refusal and our exit statuses.

Plain torchrun adds its own to a run: a refusal that every process printed is followed by its
ChildFailedError block and exit 1, and a clean stop on SIGINT or SIGTERM (every process
checkpointed and exited 0) by a SignalException traceback and exit 1. Here its agent
(`torch.distributed.run.run`, unchanged: its rendezvous, its process start, its environment for
each process) runs on a thread of this process. torchelastic then installs no signal handlers
(it does so on the main thread only), so a stop signal to this process is passed on to its
processes by this main thread, each once it catches it (distributed/stop_relay.py: one still
starting is not killed by it, one started after it still gets it), and the agent sees what they do
with it: each checkpoints the same step, or stops before its first step, and exits 0, and so does
this command. Each process hands its error line to the agent through
the file torchrun gives it for that (TORCHELASTIC_ERROR_FILE; errors.py's say_error), and the
agent's failures are said here once each: one line for a refusal all processes made, one naming
the process for one killed. The processes watch this one as their parent (run/stop_signal.py's
watch_parent): SIGKILL to it stops them with a checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from finetuning_pipeline.distributed.resume_command import BECAME_TORCHRUN
from finetuning_pipeline.distributed.stop_relay import StopRelay
from finetuning_pipeline.errors import ERRORS_TO_AGENT, SEE_THE_MASTERS, RunError
from finetuning_pipeline.run.stop_signal import PROCESS_SIGNALS


def run_torchrun_agent(rendezvous: list[str], per_node: int, script: str, argv: list[str]) -> int:
    """Run `script argv` as torchrun would with `rendezvous` and `per_node` processes on this node;
    returns the run's exit status (0 done or stopped cleanly, else the first failed process's: 2 a
    refusal, 3 a run that had to stop, 3 for a process killed by a signal)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args([*rendezvous, "--nproc-per-node", str(per_node), script, *argv])
    os.environ[BECAME_TORCHRUN] = "1"  # its processes resume as this command, which runs the agent again
    os.environ[ERRORS_TO_AGENT] = "1"
    outcome: dict = {}

    def agent() -> None:
        try:
            torchrun.run(args)
        except ChildFailedError as err:
            outcome["failures"] = err.failures
        except BaseException as err:  # (a rendezvous that failed: said on the main thread)
            outcome["error"] = err

    relay = StopRelay(lambda: child_pids(os.getpid()))
    with quiet_torchelastic(), PROCESS_SIGNALS.caught(), closed_terminal_as_sigterm():
        thread = threading.Thread(target=agent, name="torchrun-agent")
        thread.start()
        while thread.is_alive():
            thread.join(WAIT_S)  # (a join with a timeout lets the stop signals' handler run)
            relay.pass_on()
    if "error" in outcome:
        err = outcome["error"]
        raise RunError(f"torchrun's agent could not run the {per_node} processes: {type(err).__name__}: {err}")
    return report_failures(outcome.get("failures", {}), per_node)


def report_failures(failures: dict, processes: int) -> int:
    """Say each failed process's error once (on stderr, in rank order: the same refusal made by
    every process is one line) and return the first one's exit status; 0 when none failed.
    failures: torchrun's ChildFailedError.failures, {global rank: ProcessFailure}."""
    said: list[str] = []
    statuses = []
    # A process ended by SIGTERM beside another failure was stopped by the agent itself (it ends the
    # others when one fails; by torch 2.13 it also reports them): the failure is the other one.
    others = {rank: f for rank, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    # A process killed by a signal (SIGKILL, the OOM killer) is the cause; its peers' lines (another
    # replica stopped answering) are what followed from it, which torch 2.13 reports too.
    killed = {rank: f for rank, f in others.items() if f.exitcode < 0}
    for rank, failure in sorted((killed or others).items()):
        if failure.exitcode < 0:
            line = (f"error: process {rank} of {processes} was killed by {failure.signal_name()}; the run resumes "
                    "from its last complete checkpoint with --resume auto")
            statuses.append(3)
        elif said_its_own_line(failure):
            line = failure.message
            statuses.append(failure.exitcode)
        else:  # no line of ours: a traceback (a bug) it printed itself
            line = f"error: process {rank} of {processes} exited with status {failure.exitcode} (its output is above)"
            statuses.append(failure.exitcode)
        if line not in said:
            said.append(line)
    causes = [line for line in said if SEE_THE_MASTERS not in line]  # the master's, where its peers only followed
    for line in causes or said:
        print(line, file=sys.stderr, flush=True)
    return statuses[0] if statuses else 0


def said_its_own_line(failure) -> bool:
    """Whether the failed process left its error line in torchrun's error file (errors.say_error
    writes {"message": line, ...}; torchelastic's own @record writes a message of its own form)."""
    return failure.error_file != NO_ERROR_FILE and isinstance(failure.error_file_data.get("message"), str)


# What torchelastic's ProcessFailure names the error file of a process that left none.
NO_ERROR_FILE = "<N/A>"


# How often the waiting main thread wakes to pass a stop on.
WAIT_S = 0.2


@contextlib.contextmanager
def closed_terminal_as_sigterm():
    """Within the block, SIGHUP to this process (its terminal closed) is taken as SIGTERM: its
    processes, each in a session of its own out of the terminal's reach, checkpoint and stop."""
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: PROCESS_SIGNALS.handle(signal.SIGTERM, frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is `parent` (from /proc: the TPU VM's and the GPU machine's Linux)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # (state, ppid, ...) after the name
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


@contextlib.contextmanager
def quiet_torchelastic():
    """torchelastic's log lines (its rendezvous, each failure, its thread warning) are left out:
    what they say the failures' lines say once, and a user reads one command's output."""
    loggers = [logging.getLogger(name) for name in ("torch.distributed.run", "torch.distributed.elastic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
