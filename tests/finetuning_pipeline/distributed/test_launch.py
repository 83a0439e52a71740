"""The TPU host's way of starting replicas (launch.py), what it reads, and the parts of it that
need no training run: the launcher choice, the error reported, one chip of a host. Signals on
worker threads are in test_stop_signal.py; the training runs that go through the launcher in
tests/e2e/ (test_multi_replica.py, test_resume.py)."""

from __future__ import annotations

import os

import pytest

from finetuning_pipeline.distributed import launch
from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run_config import load_config


@pytest.mark.parametrize("setting, mode, kind, torchrun, expected", [
    ("auto", "dp", "TPU", 1, "tpu"),  # a TPU host: a process per chip, a replica thread per device
    ("auto", "dp", "CPU", 1, "process"),
    ("tpu", "dp", "CPU", 1, "tpu"),  # the rehearsal of a TPU run on a CPU
    ("auto", "fsdp", "TPU", 1, "process"),  # one SPMD process per host
    ("tpu", "fsdp", "CPU", 1, "process"),
    ("auto", "dp", "CPU", 2, "process"),  # each torchrun process is one replica
    ("process", "dp", "TPU", 1, "process"),
])
def test_the_launcher_each_setting_and_machine_gets(setting, mode, kind, torchrun, expected):
    assert launch.resolve_launcher(setting, mode, kind, torchrun) == expected


def test_launcher_settings_that_cannot_work_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="under torchrun leave it auto"):
        launch.resolve_launcher("tpu", "dp", "CPU", 2)
    config = tmp_path / "run.yaml"
    config.write_text("model: {path: m}\nphase1: {data: d}\n")
    with pytest.raises(ConfigError, match="parallel.launcher must be auto, tpu or process, got 'threads'"):
        load_config(config, ["parallel.launcher=threads"])
    with pytest.raises(ConfigError, match="parallel.single_chip: one chip is one replica under parallel.mode=dp"):
        load_config(config, ["parallel.single_chip=true", "parallel.mode=fsdp"])


def test_the_error_reported_is_the_cause_not_a_peer_that_saw_it():
    """Of several replicas' errors (threads of a process, or worker processes), the one that is
    not merely 'another replica stopped answering'; a dead worker process before its peers'."""
    from finetuning_pipeline.errors import CheckpointWriteError, ReplicaLost

    cause = CheckpointWriteError("could not write checkpoint step 2")
    assert launch.first_cause([ReplicaLost("replica 0: another replica stopped answering"), cause]) is cause
    lost = ReplicaLost("replica 1: another replica stopped answering")
    assert launch.first_cause([lost]) is lost
    dead = launch.WorkerDied("a replica process died (worker 1, exit code -9: killed, or out of memory)")
    died = launch.first_cause([lost, dead])
    assert isinstance(died, ReplicaLost) and str(died).startswith("a replica process died (worker 1, exit code -9")
    assert "--resume auto" in str(died)


def test_one_chip_of_a_host_is_what_torch_xla_counts_as_one_process(monkeypatch):
    """parallel.single_chip sets what torch_xla 2.9 reads: with it, its process count on an
    8-chip host is 1 (TPU_NUM_DEVICES, which the old config named, changes nothing)."""
    from torch_xla._internal import tpu

    monkeypatch.setenv("PJRT_DEVICE", "TPU")  # read by name only: the runtime here stays XLA:CPU
    monkeypatch.setattr(tpu, "num_available_chips", lambda: 8)
    for name in launch.SINGLE_CHIP_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPU_NUM_DEVICES", "1")
    assert launch.local_process_count() == 8
    launch.apply_single_chip("TPU")
    assert {name: os.environ[name] for name in launch.SINGLE_CHIP_ENV} == launch.SINGLE_CHIP_ENV
    assert launch.local_process_count() == 1
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    launch.apply_single_chip("CPU")
    assert os.environ["CPU_NUM_DEVICES"] == "1"


