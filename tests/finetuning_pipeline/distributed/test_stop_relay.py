"""A launching process passes a stop on to each of its processes once that one catches it: one
still importing is neither killed (SIGTERM) nor interrupted mid-import (SIGINT), and one started
after the stop still gets it (distributed/stop_relay.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from finetuning_pipeline.distributed.stop_relay import StopRelay, catches_stop_signals
from finetuning_pipeline.run.stop_signal import ProcessSignals

# A process that "imports" for `argv[1]` seconds before it installs its handlers, then says which
# stop signals reached it within two seconds.
STARTING = """
import signal, sys, time
time.sleep(float(sys.argv[1]))
got = []
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda signum, frame: got.append(signal.Signals(signum).name))
print("ready", flush=True)
time.sleep(2)
print("got", *got, flush=True)
"""


def starting(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", STARTING, str(seconds)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def relay_until_exit(relay: StopRelay, procs: list[subprocess.Popen]) -> list[str]:
    deadline = time.monotonic() + 30
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        relay.pass_on()
        time.sleep(0.05)
    return [proc.communicate(timeout=30)[0] for proc in procs]


def test_a_stop_waits_for_a_process_to_catch_it_and_reaches_one_started_after_it():
    signals = ProcessSignals()
    signals.handle(signal.SIGINT, None)  # Ctrl-C to the launcher, before its processes are ready
    early = starting(1.0)
    processes = [early.pid]
    relay = StopRelay(lambda: processes, signals=signals)
    relay.pass_on()
    assert not catches_stop_signals(early.pid)  # (still "importing": nothing was sent)
    time.sleep(0.3)
    late = starting(0.5)  # started after the stop
    processes.append(late.pid)
    outputs = relay_until_exit(relay, [early, late])
    assert [proc.returncode for proc in (early, late)] == [0, 0], outputs
    assert all(out.splitlines() == ["ready", "got SIGINT"] for out in outputs), outputs  # once each, no traceback
    assert not catches_stop_signals(early.pid)  # an exited process catches nothing


def test_each_later_stop_is_passed_on_too_as_translated():
    signals = ProcessSignals()
    proc = starting(0.0)
    relay = StopRelay(lambda: [proc.pid], signals=signals, translate=lambda signum: signal.SIGTERM)
    while not catches_stop_signals(proc.pid):
        time.sleep(0.05)
    relay.pass_on()  # nothing taken: nothing sent
    signals.handle(signal.SIGINT, None)
    relay.pass_on()
    time.sleep(0.3)  # (a signal pending twice is delivered once)
    signals.handle(signal.SIGINT, None)
    (out,) = relay_until_exit(relay, [proc])
    assert out.splitlines() == ["ready", "got SIGTERM SIGTERM"], out
