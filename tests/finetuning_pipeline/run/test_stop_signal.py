"""Stop signals and the session budget: a preemption (SIGTERM) or Ctrl-C reaches every replica,
on worker threads too, and train.max_wall_time stops before the session ends."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from finetuning_pipeline.run.stop_signal import ProcessSignals, StopOnSignal, WallClockBudget


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


def test_the_session_budget_leaves_twice_the_slowest_step():
    times = iter([10.0, 30.0, 40.0, 61.0])
    budget = WallClockBudget(100.0, 0.0, clock=lambda: next(times))
    assert [budget.exhausted() for _ in range(4)] == [False, False, False, True]  # 61 + 2 x 21 >= 100
