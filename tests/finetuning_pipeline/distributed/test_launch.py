"""The TPU host's way of starting replicas (launch.py), what it reads, and the parts of it that
need no training run: the launcher choice, the error reported, one chip of a host. Signals on
worker threads are in test_stop_signal.py; the training runs that go through the launcher in
tests/e2e/ (test_multi_replica.py, test_resume.py)."""

from __future__ import annotations

import os

import pytest

from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run_config import load_config
from finetuning_pipeline.runtime.xla import launch


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


@pytest.mark.parametrize("users", [None, "1"])
def test_the_launching_process_hides_torch_xla_from_transformers_until_its_workers_start(monkeypatch, users):
    """USE_TORCH_XLA=0 while the launching process checks the inputs (transformers and accelerate
    then leave torch_xla unimported there), and the user's own setting, or none, for the workers it
    spawns (their environment is its own as they start); hidden twice, shown once, is shown."""
    if users is None:
        monkeypatch.delenv("USE_TORCH_XLA", raising=False)
    else:
        monkeypatch.setenv("USE_TORCH_XLA", users)
    hidden = launch.HiddenTorchXla()
    hidden.hide()
    hidden.hide()
    assert os.environ["USE_TORCH_XLA"] == "0"
    hidden.show()
    assert os.environ.get("USE_TORCH_XLA") == users
    hidden.show()  # (nothing hidden: nothing changed)
    assert os.environ.get("USE_TORCH_XLA") == users


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
    tpu_vm_metadata(monkeypatch, "v5litepod-8", hosts=1, worker=0)
    monkeypatch.setenv("TPU_NUM_DEVICES", "1")
    assert launch.local_process_count() == 8
    launch.apply_single_chip("TPU")
    assert {name: os.environ[name] for name in launch.SINGLE_CHIP_ENV} == launch.SINGLE_CHIP_ENV
    assert launch.local_process_count() == 1
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    launch.apply_single_chip("CPU")
    assert os.environ["CPU_NUM_DEVICES"] == "1"




def tpu_vm_metadata(monkeypatch, accelerator: str, hosts: int, worker: int) -> None:
    """What torch_xla reads of a TPU VM's metadata, from the variables it takes in its place
    (TPU_SKIP_MDS_QUERY: tpu.build_tpu_env_from_vars): a host of 2x2 chips, `hosts` of them in a row."""
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", accelerator)
    monkeypatch.setenv("TPU_HOST_BOUNDS", f"1,{hosts},1")
    monkeypatch.setenv("TPU_CHIPS_PER_HOST_BOUNDS", "2,2,1")
    monkeypatch.setenv("TPU_WORKER_ID", str(worker))
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", ",".join(f"10.0.0.{index}" for index in range(hosts)))
    for name in TOPOLOGY:  # (set first: what configure_topology sets then goes when the test ends)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


# What torch_xla's configure_topology sets when it is unset: the slice's processes and this one's place.
TOPOLOGY = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS", "CLOUD_TPU_TASK_ID",
            "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT")


@pytest.mark.parametrize("hosts", [1, 4])
def test_one_chip_is_a_slice_of_one_process_on_a_single_host_and_on_a_pods_host_0(monkeypatch, hosts):
    """The environment torch_xla's own configure_topology leaves (the launcher's worker runs it),
    on a VM whose metadata says `hosts` hosts: the slice's process bounds hold as many processes
    as it has addresses, this one is task 0 of them, on its chip 0. Before the slice's own task and
    address were set, host 0 of a pod was task 0 of a one-process slice that listed 4 addresses."""
    from torch_xla._internal import tpu

    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    tpu_vm_metadata(monkeypatch, "v5litepod-16" if hosts > 1 else "v5litepod-4", hosts=hosts, worker=0)
    launch.apply_single_chip("TPU")
    tpu.configure_topology(local_rank=0, local_world_size=1)
    addresses = os.environ["TPU_PROCESS_ADDRESSES"].split(",")
    processes = tpu.MeshShape.from_string(os.environ["TPU_PROCESS_BOUNDS"]).size
    assert processes == len(addresses) == 1 and int(os.environ["CLOUD_TPU_TASK_ID"]) == 0
    assert os.environ["TPU_VISIBLE_CHIPS"] == "0" and os.environ["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
    assert os.environ["TPU_PROCESS_PORT"] == addresses[0].split(":")[1]


def test_one_chip_on_a_pods_other_hosts_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    tpu_vm_metadata(monkeypatch, "v5litepod-16", hosts=4, worker=2)
    with pytest.raises(ConfigError, match="this is host 2: run it on host 0 alone"):
        launch.apply_single_chip("TPU")
    assert "TPU_PROCESS_BOUNDS" not in os.environ  # nothing set
