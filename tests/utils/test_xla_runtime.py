"""Which device a command runs on when PJRT_DEVICE is not set: said once, in our words."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import finetuning_pipeline.runtime.xla.device
from finetuning_pipeline.runtime.xla.device import choose_device


@pytest.mark.parametrize("chips, device", [(0, "CPU"), (4, "TPU")])
def test_unset_it_is_the_tpu_where_one_is_found_and_the_cpu_elsewhere(monkeypatch, chips, device):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(finetuning_pipeline.runtime.xla.device, "tpu_chips", lambda: chips)
    said = []
    assert choose_device(said.append) == device
    found = f"{chips} TPU chips found" if chips else "no TPU found on this machine"
    assert said == [f"device: {device} (PJRT_DEVICE is not set and {found}; set PJRT_DEVICE=CPU or PJRT_DEVICE=TPU "
                    "to choose)"]
    assert choose_device(said.append) == device and len(said) == 1  # once: the process now has it set


def test_set_it_is_taken_as_it_is_without_a_word(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    said = []
    assert choose_device(said.append) == "CPU" and said == []


@pytest.mark.parametrize("value", ["CUDA", "cpu", ""])
def test_a_device_the_xla_runtime_does_not_run_on_is_named_with_what_to_set(monkeypatch, value):
    """torch_xla's own word for these is a KeyError or a missing plugin in a replica's traceback."""
    from finetuning_pipeline.errors import ConfigError

    monkeypatch.setenv("PJRT_DEVICE", value)
    with pytest.raises(ConfigError, match=rf"PJRT_DEVICE='{value}': the XLA runtime runs on PJRT_DEVICE=CPU or "
                       "PJRT_DEVICE=TPU \\(upper case\\); on a GPU, unset PJRT_DEVICE"):
        choose_device()


@pytest.mark.parametrize("command", ["main", "tpu_check"])
def test_a_command_on_a_bad_pjrt_device_says_one_line_and_exits_2(tmp_path, tiny_model_dir, data, command,
                                                                   monkeypatch, capsys):
    import importlib

    from trainer_helpers import write_run_config

    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out")
    monkeypatch.setenv("PJRT_DEVICE", "CUDA")
    assert importlib.import_module(f"finetuning_pipeline.{command}").main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: PJRT_DEVICE='CUDA': the XLA runtime runs on PJRT_DEVICE=CPU or PJRT_DEVICE=TPU (upper case); on a GPU, "
        "unset PJRT_DEVICE and train on the native runtime (runtime.backend=native)"]
    assert not (tmp_path / "out").exists()


@pytest.mark.heavy
def test_torch_xla_never_guesses_and_warns_in_a_command(tmp_path):
    """A command run without PJRT_DEVICE: our one line, not torch_xla's WARNING."""
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    code = ("from finetuning_pipeline.runtime.xla.device import init_xla_device; import torch; "
            "print((torch.ones(2, device=init_xla_device()) * 2).sum().item())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "4.0", done.stderr
    assert "device: CPU (PJRT_DEVICE is not set" in done.stderr and "Defaulting to PJRT_DEVICE" not in done.stderr


@pytest.mark.heavy
def test_a_command_on_the_host_cpu_takes_the_cpu_without_a_probe_or_a_warning(tiny_model_dir):
    """generate (as export and evaluate --device cpu) computes on torch's CPU device: torch_xla,
    imported by transformers, is told CPU before it guesses."""
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    done = subprocess.run([sys.executable, "-m", "finetuning_pipeline.generate", "--model", str(tiny_model_dir),
                           "--prompt", "Bună", "--max-new-tokens", "2"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "PJRT_DEVICE" not in done.stderr and "Defaulting" not in done.stderr
