"""The Makefile's demo: every step after training reads the run it trained, wherever ARGS put it
(`make demo ARGS="output_dir=DIR"`), never an earlier run under the demo's own output_dir. And
every test marked `native` is one `make test-native` runs (`make test` leaves its end-to-end runs
to it). Read from `make -n` (what make would run, nothing run)."""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import REPO


def demo_commands(args: str) -> str:
    proc = subprocess.run(["make", "-n", "-C", str(REPO), "demo", f"ARGS={args}"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("args, run", [("", "outputs/demo"), ("output_dir=/tmp/elsewhere", "/tmp/elsewhere"),
                                       ("train.max_steps=2 output_dir=runs/a output_dir=runs/b", "runs/b")])
def test_the_demo_merges_asks_and_exports_the_run_it_trained(args, run):
    commands = demo_commands(args)
    trained = [line for line in commands.splitlines() if "finetuning_pipeline/main.py" in line]
    assert len(trained) == 1 and trained[0].endswith(args)
    assert f"--adapter {run}/phase3/adapter --out {run}/merged " in commands  # the last phase's
    assert f"--model {run}/merged --prompt" in commands
    assert f"--adapter {run}/phase3/adapter --out {run}/merged-q8_0.gguf" in commands
    assert f"--model {run}/merged-q8_0.gguf --prompt" in commands
    if run != "outputs/demo":  # the base it was trained on stays the demo's; nothing else of outputs/demo is read
        assert "outputs/demo/phase2" not in commands and "outputs/demo/merged" not in commands
        assert "--base outputs/demo/base" in commands


def test_every_test_marked_native_is_in_make_test_natives_files():
    """`make test` deselects the tests marked both native and slow: one in a file `make test-native`
    does not name would run nowhere."""
    proc = subprocess.run(["make", "-n", "-C", str(REPO), "test-native"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pytest_line = next(line for line in proc.stdout.splitlines() if " -m pytest " in line)
    named = [REPO / arg for arg in pytest_line.split(" -m native ")[1].split()]
    marked = [path for path in (REPO / "tests").rglob("test_*.py")
              if re.search(r"^(@pytest\.mark\.native$|pytestmark = .*pytest\.mark\.native)", path.read_text(), re.M)]
    assert marked and all(any(path == n or n in path.parents for n in named) for path in marked), (marked, named)
