"""The Makefile's demo: every step after training reads the run it trained, wherever ARGS put it
(`make demo ARGS="output_dir=DIR"`), never an earlier run under the demo's own output_dir. Read
from `make -n` (what make would run, nothing run)."""

from __future__ import annotations

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
    assert f"--adapter {run}/phase2/adapter --out {run}/merged " in commands
    assert f"--model {run}/merged --prompt" in commands
    assert f"--adapter {run}/phase2/adapter --out {run}/merged-q8_0.gguf" in commands
    assert f"--model {run}/merged-q8_0.gguf --prompt" in commands
    if run != "outputs/demo":  # the base it was trained on stays the demo's; nothing else of outputs/demo is read
        assert "outputs/demo/phase2" not in commands and "outputs/demo/merged" not in commands
        assert "--base outputs/demo/base" in commands
