"""The command a stopped run prints to resume it: as the user started it, launcher included."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

from finetuning_pipeline.distributed.resume_command import BECAME_TORCHRUN, resume_command, torchrun_prefix

pytestmark = pytest.mark.native
MAIN = Path(__file__).resolve().parents[3] / "finetuning_pipeline" / "main.py"
SCRIPT = os.path.relpath(MAIN)  # as the command names it, from where it runs
ARGS = ["--config", "run.yaml", "--phase", "1", "--resume", "auto", "runtime.backend=native"]


@pytest.fixture
def under_torchrun(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "4")


def test_one_process_resumes_as_python_main(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    command = resume_command(MAIN, ARGS, ("PJRT_DEVICE", "CPU_NUM_DEVICES"), environ={"PJRT_DEVICE": "CPU"})
    assert shlex.split(command) == ["PJRT_DEVICE=CPU", sys.executable, SCRIPT, *ARGS]


@pytest.mark.parametrize("agent", [
    ["/venv/bin/python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"],
    ["/venv/bin/python", "/venv/bin/torchrun", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h0:29400",
     "--nproc-per-node", "2"],
])
def test_a_torchrun_process_resumes_as_the_torchrun_command_that_started_it(under_torchrun, agent):
    """Its process count and rendezvous as the user typed them: another count is another global batch."""
    command = resume_command(MAIN, ARGS, (), environ={}, parent_command=[*agent, "finetuning_pipeline/main.py",
                                                                          "--config", "run.yaml", "--phase", "1"])
    assert shlex.split(command) == [*agent, SCRIPT, *ARGS]


def test_the_command_is_rebuilt_from_torchruns_environment_where_its_line_cannot_be_read(under_torchrun):
    one_node = {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}
    command = shlex.split(resume_command(MAIN, ARGS, (), environ=one_node, parent_command=[]))
    assert command[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    nodes = {"LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "h0",
             "MASTER_PORT": "29500"}
    command = shlex.split(resume_command(MAIN, ARGS, (), environ=nodes, parent_command=["bash"]))
    assert command[3:13] == ["--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                             "h0:29500", "--nproc-per-node", "2"]


def test_a_torchrun_main_py_became_resumes_as_main_py(under_torchrun):
    """TorchTPU on a TPU host: the user ran main.py, which ran torchrun's agent; pasted again, it does so again."""
    agent = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(MAIN)]
    command = shlex.split(resume_command(MAIN, ARGS, (), environ={BECAME_TORCHRUN: "1"}, parent_command=agent))
    assert command == [sys.executable, SCRIPT, *ARGS]


def test_only_a_torchrun_running_this_script_is_taken_for_the_launcher():
    assert torchrun_prefix(["python", "-m", "torch.distributed.run", "other.py"], MAIN) is None
    assert torchrun_prefix(["python", "somewhere/main.py"], MAIN) is None  # not torchrun: a parent of another kind
    assert torchrun_prefix(None, MAIN) is None
    assert torchrun_prefix(["python", "-m", "torch.distributed.run", "--standalone", "/abs/finetuning_pipeline/main.py",
                            "x"], MAIN) == ["python", "-m", "torch.distributed.run", "--standalone"]
