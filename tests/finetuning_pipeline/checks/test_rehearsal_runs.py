"""The runs a rehearsal or `make tpu-check` starts end in bounded time: a hung run (what the check
exists to find) is asked for its stacks, killed with every process it started, and reported."""

from __future__ import annotations

import time

import pytest
from trainer_helpers import process_alive, startup_patch

from finetuning_pipeline.checks import rehearsal

# main.py stands hung before its first step, with a child of its own (as the TPU launcher's
# worker): both must go, and the hung one's stacks must be in its output.
HUNG_MAIN = """
import os, signal, subprocess, sys, time, faulthandler
if sys.argv and sys.argv[0].endswith("main.py"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.environ["HUNG_CHILD_PID"], "w").write(str(child.pid))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    def waiting_for_a_peer_that_never_comes():
        while True:
            time.sleep(1)
    waiting_for_a_peer_that_never_comes()
"""


@pytest.mark.heavy
def test_a_run_that_hangs_is_killed_with_its_children_after_its_stacks_and_fails(tmp_path):
    env = {**startup_patch(tmp_path, HUNG_MAIN), "HUNG_CHILD_PID": str(tmp_path / "child.pid")}
    started = time.monotonic()
    proc = rehearsal.run_trainer(tmp_path / "run.yaml", ["--phase", "1"], "dp", tmp_path / "log.txt", env=env,
                                 timeout_s=3)
    took = time.monotonic() - started
    assert proc.returncode != 0 and took < 3 + rehearsal.STACKS_S + 30, (proc.returncode, took)
    assert "did not end within 3 s and was killed" in proc.stderr
    assert "waiting_for_a_peer_that_never_comes" in proc.stderr  # its stacks, asked for before the kill
    assert "did not end within 3 s" in (tmp_path / "log.txt").read_text()
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10  # (reparented once its parent died: reaped a moment later)
    while process_alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(child)
