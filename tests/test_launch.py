"""The TPU host's way of starting replicas (launch.py), what it reads, and the parts of it that
need no training run: the launcher choice, signals on worker threads, one chip of a host, the
TPU detection the notebook uses, the config chosen without --config. The training runs that
go through the launcher are in test_multi_replica.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from finetuning_pipeline import launch
from finetuning_pipeline.config import load_config
from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.stop_signal import ProcessSignals, StopOnSignal
from trainer_helpers import prepare_demo_data
from utils.tpu_detect import TPU_PCI_DEVICES, tpu_chips

ROOT = Path(__file__).resolve().parent.parent


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
    with pytest.raises(ConfigError, match="parallel.launcher must be one of auto, tpu, process"):
        load_config(config, ["parallel.launcher=threads"])
    with pytest.raises(ConfigError, match="parallel.single_chip: one chip is one replica under parallel.mode=dp"):
        load_config(config, ["parallel.single_chip=true", "parallel.mode=fsdp"])


def test_the_error_reported_is_the_cause_not_a_peer_that_saw_it():
    """Of several replicas' errors (threads of a process, or worker processes), the one that is
    not merely 'another replica stopped answering'; a dead worker process as ReplicaLost."""
    from concurrent.futures.process import BrokenProcessPool

    from finetuning_pipeline.errors import CheckpointWriteError, ReplicaLost

    cause = CheckpointWriteError("could not write checkpoint step 2")
    assert launch.first_cause([ReplicaLost("replica 0: another replica stopped answering"), cause]) is cause
    lost = ReplicaLost("replica 1: another replica stopped answering")
    assert launch.first_cause([lost]) is lost
    died = launch.first_cause([BrokenProcessPool("terminated abruptly"), lost])
    assert isinstance(died, ReplicaLost) and "a replica process died" in str(died)


def in_worker_thread(fn):
    """fn() on a thread that is not the main thread, as torch_xla's launcher runs a replica."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            outcome["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_a_replica_on_a_worker_thread_refuses_to_start_when_its_process_catches_no_signal():
    """The fault of torch_xla.launch on a TPU: the replica runs on a worker thread, where no
    handler can be installed; a preemption would kill it without a checkpoint."""
    signals = ProcessSignals()
    with pytest.raises(RuntimeError, match="catches no stop signal"):
        in_worker_thread(lambda: StopOnSignal(signals=signals).__enter__())
    with pytest.raises(RuntimeError, match="only be installed on a process's main thread"):
        in_worker_thread(signals.install)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_reaches_replicas_on_worker_threads(sig):
    """What the launcher does in each worker process: handlers on the main thread, replicas on
    threads; both threads' StopOnSignal see the signal, and it names itself."""
    signals = ProcessSignals()
    signals.install()
    try:
        stops = [in_worker_thread(lambda: StopOnSignal(signals=signals).__enter__()) for _ in range(2)]
        assert not any(stop.requested() for stop in stops)
        os.kill(os.getpid(), sig)
        assert all(stop.requested() for stop in stops)
        assert stops[1].reason() == sig.name
    finally:
        signals.restore()
    assert signal.getsignal(sig) is not signals.handle


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


def fake_pci_device(sysfs: Path, slot: str, vendor: str, device: str) -> None:
    path = sysfs / "bus" / "pci" / "devices" / slot
    path.mkdir(parents=True)
    (path / "vendor").write_text(vendor + "\n")
    (path / "device").write_text(device + "\n")


@pytest.mark.parametrize("generation, device_id", [("v2/v3", "0x0027"), ("v4", "0x005e"), ("v5e", "0x0063"),
                                                   ("v6e", "0x006f"), ("7x", "0x0076")])
def test_the_notebook_finds_every_tpu_generation_on_the_pci_bus(tmp_path, generation, device_id):
    for chip in range(4):
        fake_pci_device(tmp_path, f"0000:00:0{chip + 4}.0", "0x1ae0", device_id)
    fake_pci_device(tmp_path, "0000:00:03.0", "0x1ae0", "0x0042")  # gVNIC: Google's vendor id, not a TPU
    fake_pci_device(tmp_path, "0000:00:01.0", "0x8086", "0x7110")
    assert tpu_chips(tmp_path) == 4
    assert tpu_chips(tmp_path / "nothing") == 0


def test_the_tpu_device_ids_are_torch_xlas():
    from torch_xla._internal import tpu

    assert list(TPU_PCI_DEVICES) == tpu._TPU_PCI_DEVICE_IDS and tpu._GOOGLE_PCI_VENDOR_ID == "0x1ae0"


def test_without_config_the_embedded_default_runs_from_any_directory(tiny_model_dir, tmp_path):
    """`python main.py` as users type it on a TPU VM, from finetuning_pipeline/: the demo
    config, its paths anchored at the repository (here overridden to the test's inputs, so
    nothing is built), and a resume command that chooses it again."""
    data = prepare_demo_data(tiny_model_dir, tmp_path / "data")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TPU_LORA_CONFIG"}
    done = subprocess.run(
        [sys.executable, "main.py", "--phase", "1", f"model.path={tiny_model_dir}", f"phase1.data={data[1]}",
         f"output_dir={out}", "train.max_steps=3", "train.micro_batch=2", "eval.every=0", "eval.max_batches=1",
         "checkpoint.every=0", "logging.progress_bar=false", "train.max_wall_time=1s"],
        cwd=ROOT / "finetuning_pipeline", env={**env, "PJRT_DEVICE": "CPU"}, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    default = ROOT / "finetuning_pipeline" / "configs" / "demo.yaml"
    assert f"config: {default} (the embedded default: no --config given" in done.stdout
    assert "building the embedded default" not in done.stdout
    # The budget ran out after step 1: the printed command resumes without --config, as given.
    resume = done.stdout.split("the next session continues with the same command:\n")[1].splitlines()[0]
    assert "--config" not in resume and "main.py --phase 1 --resume auto" in resume
    assert (out / "phase1" / "checkpoints").is_dir()


def test_the_default_configs_paths_are_anchored_at_the_repository(monkeypatch, tmp_path):
    from finetuning_pipeline.demo_inputs import DEMO_CONFIG, REPO, anchored_paths
    from finetuning_pipeline.main import choose_config

    monkeypatch.chdir(tmp_path)
    anchored = dict(override.split("=", 1) for override in anchored_paths(DEMO_CONFIG, REPO))
    assert anchored == {"output_dir": str(REPO / "outputs/demo"), "model.path": str(REPO / "outputs/demo/base"),
                        "phase1.data": str(REPO / "outputs/demo/data/phase1"),
                        "phase2.data": str(REPO / "outputs/demo/data/phase2")}
    mine = tmp_path / "mine.yaml"
    monkeypatch.setenv("TPU_LORA_CONFIG", str(mine))
    assert choose_config(None, ["train.lr=1e-3"]) == (mine, ["train.lr=1e-3"])
    assert choose_config("given.yaml", []) == (Path("given.yaml"), [])


def test_the_default_builds_only_the_demo_inputs_this_run_reads(monkeypatch, tmp_path):
    """On a fresh clone `python main.py --phase 1` builds the tiny base and phase 1's data; the
    data only on the demo's own base (it is prepared with its tokenizer), nothing overridden."""
    from types import SimpleNamespace

    from finetuning_pipeline import demo_inputs

    paths = {what: tmp_path / what for what in ("base", "phase1", "phase2")}
    built = []
    monkeypatch.setattr(demo_inputs, "demo_paths", lambda: paths)
    monkeypatch.setattr(demo_inputs, "build", lambda what, force=False: built.append(what) or 0)

    def config(base, phase1=paths["phase1"], phase2=paths["phase2"]):
        return SimpleNamespace(model=SimpleNamespace(path=str(base)), phase1=SimpleNamespace(data=str(phase1)),
                               phase2=SimpleNamespace(data=str(phase2)))

    demo_inputs.ensure_demo_inputs(config(paths["base"]), [1])
    assert built == ["base", "phase1"]
    built.clear()
    demo_inputs.ensure_demo_inputs(config(tmp_path / "my-model"), [1, 2])
    assert built == []
    (paths["base"] / "config.json").parent.mkdir()
    (paths["base"] / "config.json").write_text("{}")
    demo_inputs.ensure_demo_inputs(config(paths["base"], phase1=tmp_path / "mine"), [1, 2])
    assert built == ["phase2"]
