"""kill -USR1 on a trainer process prints every thread's stack and the process carries on; a fatal
signal prints them as it dies."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from conftest import REPO

WAITING = """
import sys, threading, time
from utils.stack_dump import dump_stacks_on_signal

dump_stacks_on_signal()
stop = threading.Event()

def parked_in_a_wait():
    stop.wait()

thread = threading.Thread(target=parked_in_a_wait)
thread.start()
print("ready", flush=True)
time.sleep(2)  # the signal arrives meanwhile
stop.set()
thread.join()
print("carried on", flush=True)
"""


def test_sigusr1_dumps_every_threads_stack_and_the_process_carries_on():
    proc = subprocess.Popen([sys.executable, "-c", WAITING], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == "carried on", err
    assert err.count("(most recent call first)") == 2 and "in parked_in_a_wait" in err and "<module>" in err, err


def test_a_fatal_signal_prints_every_threads_stack_as_the_process_dies():
    """kill -ABRT (what the tests send a hung run before killing it), or a crash: faulthandler
    prints every thread's stack, whatever the threads are blocked in."""
    proc = subprocess.Popen([sys.executable, "-c", WAITING], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGABRT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in err and "in parked_in_a_wait" in err and "Current thread" in err, err
