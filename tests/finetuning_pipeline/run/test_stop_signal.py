"""Stop signals and the session budget: a preemption (SIGTERM) or Ctrl-C reaches every replica,
on worker threads too, and train.max_wall_time stops before the session ends."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from finetuning_pipeline.run.stop_signal import (
    ProcessSignals,
    StopOnSignal,
    WallClockBudget,
    stopped_before_step,
    watch_parent,
)


def in_worker_thread(fn):
    """fn() on a thread that is not the main thread, as torch_xla's launcher runs a replica."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as err:
            outcome["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_a_replica_on_a_worker_thread_refuses_to_start_when_its_process_catches_no_signal():
    """The fault of torch_xla.launch on a TPU: the replica runs on a worker thread, where no
    handler can be installed; a preemption would kill it without a checkpoint."""
    signals = ProcessSignals()
    with pytest.raises(RuntimeError, match="catches no stop signal"):
        in_worker_thread(lambda: StopOnSignal(signals=signals).__enter__())
    with pytest.raises(RuntimeError, match="only be installed on a process's main thread"):
        in_worker_thread(signals.install)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_reaches_replicas_on_worker_threads(sig):
    """What the launcher does in each worker process: handlers on the main thread, replicas on
    threads; both threads' StopOnSignal see the signal, and it names itself."""
    signals = ProcessSignals()
    signals.install()
    try:
        stops = [in_worker_thread(lambda: StopOnSignal(signals=signals).__enter__()) for _ in range(2)]
        assert not any(stop.requested() for stop in stops)
        os.kill(os.getpid(), sig)
        assert all(stop.requested() for stop in stops)
        assert stops[1].reason() == sig.name
    finally:
        signals.restore()
    assert signal.getsignal(sig) is not signals.handle


def test_a_watched_parent_stops_the_replica_at_its_next_step_and_names_the_stop_after_another_replicas_vote():
    """watch_parent: the parent's exit is asked at each step (no thread, no wait), and again when
    the stop is named: torchrun's processes are re-parented at once, so the master that stopped
    on a peer's vote one step before it saw the exit itself still names the cause."""
    signals = ProcessSignals()
    parent = {"pid": os.getppid()}
    signals.watch(lambda: os.getppid() != parent["pid"], "torchrun's exit")
    master, peer = StopOnSignal(signals=signals), StopOnSignal(signals=ProcessSignals())
    assert not master.requested() and master.reason() == "another replica's request"
    parent["pid"] = -1  # the parent dies between the master's ask and the name of the stop
    assert master.reason() == "torchrun's exit" and master.requested()
    assert "stopped on torchrun's exit after a checkpoint at step 3 of phase 1" in master.after_stop(3, 1, "cmd")
    assert not peer.requested()
    watch_parent(os.getppid(), peer.signals, "its launching process's exit")
    assert not peer.requested()  # its parent lives
    later = ProcessSignals()
    later.watch(lambda: True, "a parent of a finished run")
    later.restore()  # the run is over: its watches end with its handlers
    assert not later.poll()


def test_the_session_budget_leaves_twice_the_slowest_step():
    times = iter([10.0, 30.0, 40.0, 61.0])
    budget = WallClockBudget(100.0, 0.0, clock=lambda: next(times))
    assert [budget.exhausted() for _ in range(4)] == [False, False, False, True]  # 61 + 2 x 21 >= 100


def test_a_signal_that_interrupts_the_handler_itself_never_deadlocks():
    """Python runs a second signal's handler on the same thread, between any two lines of the first
    one's. With a threading.Event as the flag, a second SIGTERM that came while Event.set held its
    lock waited on that lock forever (a CI run hung so, the launcher forwarding SIGTERM to a worker
    the test had signalled too). Here the second handler is run at each line the first one runs,
    callees included, one line per try, each try bounded in time."""
    tried: set = set()

    def one_try() -> bool:
        """One handler interrupted at the first line not tried yet; False when none was left."""
        signals = ProcessSignals()
        outer = signals.request.__code__
        fired = []

        def under_request(frame) -> bool:
            while frame is not None:
                if frame.f_code is outer:
                    return True
                frame = frame.f_back
            return False

        def local(frame, event, arg):
            point = (frame.f_code, frame.f_lineno)
            if event == "line" and not fired and point not in tried and under_request(frame):
                tried.add(point)
                fired.append(point)
                signals.handle(signal.SIGINT, None)  # the nested handler, as Python would run it here
            return local

        def run() -> None:
            sys.settrace(lambda frame, event, arg: local)
            try:
                signals.handle(signal.SIGTERM, None)
            finally:
                sys.settrace(None)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(5)
        assert not thread.is_alive(), f"the nested handler hung, interrupting the first at {fired}"
        assert signals.stop_requested and signals.received in ("SIGTERM", "SIGINT")
        return bool(fired)

    tries = 0
    while one_try():
        tries += 1
    assert tries >= 2  # every line of request was interrupted once


def test_a_stop_taken_during_start_up_is_kept_by_the_replica_that_comes_later():
    """main.py catches the stop signals from its first lines; the replica's StopOnSignal, entered
    seconds later on the same main thread, keeps those handlers and the stop they took (before,
    its own install cleared it: the run trained every step), and leaves them to main.py."""
    signals = ProcessSignals()
    assert signals.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # while the command still imports and checks its inputs
        assert not signals.install()  # (installed already: kept as they are)
        with StopOnSignal(budget=WallClockBudget(3600, started=0, clock=lambda: 1.0), signals=signals) as stop:
            assert stop.signalled() and stop.requested() and stop.reason() == "SIGINT"
        assert signal.getsignal(signal.SIGINT) == signals.handle  # still main.py's, until main.py ends
        assert signals.signals_received == [signal.SIGINT]
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is not signals.handle
    assert not signals.stop_requested and signals.received is None and not signals.signals_received
    with signals.caught():  # the block's owner installs and restores
        assert signal.getsignal(signal.SIGTERM) == signals.handle
        with signals.caught():  # a nested block leaves them to it
            pass
        assert signal.getsignal(signal.SIGTERM) == signals.handle
    assert signal.getsignal(signal.SIGTERM) is not signals.handle


def test_the_session_budget_is_not_a_stop_before_the_first_step():
    """signalled(), asked before a phase's first step, is the signals' alone: a session whose
    budget ran out during start-up still trains a step (and checkpoints it) rather than start and
    stop forever; requested(), asked after each step, counts the budget."""
    stop = StopOnSignal(budget=WallClockBudget(10, started=0, clock=lambda: 11.0), signals=ProcessSignals())
    assert not stop.signalled() and stop.requested()


def test_a_stop_before_the_first_step_says_what_exists_and_claims_no_checkpoint():
    fresh = stopped_before_step("SIGTERM", 0, 2, "python main.py --resume auto")
    assert fresh.startswith("stopped on SIGTERM before the first step of phase 2: nothing of it was trained and no "
                            "checkpoint written; the same command starts it:\n  python main.py --resume auto")
    assert "resume with" not in fresh
    resumed = stopped_before_step("SIGINT", 4, 1, "cmd")
    assert resumed == ("stopped on SIGINT before step 5 of phase 1, nothing trained since its checkpoint at step 4; "
                       "resume with:\n  cmd")
