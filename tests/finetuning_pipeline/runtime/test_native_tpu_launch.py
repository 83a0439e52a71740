"""The native runtime's processes on a TPU host (runtime/native/tpu_launch.py): main.py with
runtime.device=tpu sets TorchTPU's launch environment and runs torchrun's agent, a process per chip.
No TPU here: TorchTPU's torch_tpu is a stand-in whose set_tpu_launch_env sets the variables the
real one (torch_tpu 0.2.0) sets, in the shapes it sets them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.runtime.native.tpu_launch import torchrun_arguments

pytestmark = pytest.mark.native


def test_a_host_of_four_chips_is_four_processes_and_one_chip_is_this_one():
    host = {"TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(f"localhost:{port}" for port in range(8070, 8074))}
    assert torchrun_arguments(host) == (["--standalone"], 4)
    assert torchrun_arguments({"TORCH_TPU_SLICEBUILDER_ADDRESSES": "localhost:8070"}) is None


def test_a_pods_host_joins_the_others_at_the_rendezvous_set_tpu_launch_env_chose():
    pod = {"TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(f"10.0.0.{h}:{8070 + c}" for h in range(2) for c in range(4)),
           "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.0", "MASTER_PORT": "29500"}
    assert torchrun_arguments(pod) == (
        ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.0", "--master-port", "29500"], 4)
    with pytest.raises(ConfigError, match="names 6 ranks .* for 4 hosts"):
        torchrun_arguments({**pod, "NNODES": "4", "TORCH_TPU_SLICEBUILDER_ADDRESSES": "a:1," * 5 + "a:1"})


FAKE_TORCH_TPU = '''
"""A stand-in for torch_tpu: torch.tpu with set_tpu_launch_env (a host of 2 chips) and no TPU."""
import os
import types

import torch


def set_tpu_launch_env(*, nnodes=None, nproc_per_node=None):
    os.environ.setdefault("TORCH_TPU_SLICEBUILDER_ADDRESSES", "localhost:8070,localhost:8071")
    os.environ.setdefault("TORCH_TPU_TOPOLOGY", "1,2,1")
    print("set_tpu_launch_env in", os.getpid(), flush=True)


def is_available():
    print(f"worker {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')}, {os.environ.get('TORCH_TPU_TOPOLOGY')}",
          flush=True)
    print(f"resumes as main.py: {os.environ.get('TPU_LORA_BECAME_TORCHRUN')}", flush=True)
    return False


torch.tpu = types.SimpleNamespace(distributed=types.SimpleNamespace(set_tpu_launch_env=set_tpu_launch_env),
                                  is_available=is_available)
'''


@pytest.mark.heavy
def test_main_becomes_torchrun_whose_processes_run_main_with_the_same_arguments(tiny_model_dir, data, tmp_path):
    """Through the real command: main.py (no torchrun) sets the launch environment once and
    runs torchrun's agent over 2 processes (this host's chips), each main.py with the same arguments,
    which do not launch again and here stop at TorchTPU's device: no TPU on this machine."""
    from trainer_helpers import write_run_config

    (tmp_path / "fake" / "torch_tpu").mkdir(parents=True)
    (tmp_path / "fake" / "torch_tpu" / "__init__.py").write_text(textwrap.dedent(FAKE_TORCH_TPU))
    out = tmp_path / "out"
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, out, train={"max_steps": 2})
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'fake'}:{os.getcwd()}"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    proc = subprocess.run([sys.executable, "finetuning_pipeline/main.py", "--config", str(config), "--phase", "1",
                           "runtime.backend=native", "runtime.device=tpu"], capture_output=True, text=True,
                          timeout=600, env=env, check=False)
    output = proc.stdout + proc.stderr
    assert "runtime.device=tpu: 2 processes on this host under torchrun's agent (1 hosts)" in output, output
    assert output.count("set_tpu_launch_env in") == 1, output  # the parent only: its workers inherit the result
    # torchrun's workers, with the launch environment: each asks TorchTPU for its device and stops (torchrun
    # may end the second once the first has failed, before it asks)
    workers = set(re.findall(r"worker (\d) of 2, 1,2,1", output))
    assert workers and workers <= {"0", "1"}, output
    # each worker's refusal, said once by the agent main.py runs, with the refusal's own exit status
    assert output.count("TorchTPU is installed but finds no TPU on this machine") == 1, output
    # the user's command was main.py: a stopped worker's resume command is it, not torchrun's (resume_command)
    assert "resumes as main.py: 1" in output, output
    assert proc.returncode == 2 and not (out / "phase1").exists(), output  # nothing written before the launch
    assert "Traceback" not in output and "ChildFailedError" not in output, output
