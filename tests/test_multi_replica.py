"""Several replicas on a CPU: the real trainer as N replicas talking through gloo on the
loopback (collectives.py), started the way a TPU host starts them (parallel.launcher=tpu: a
launching process, a worker process, a replica thread per device; CPU_NUM_DEVICES=2 is the TPU
v2/v3 shape) or as N torchrun processes, the way a pod's hosts run side by side.

XLA:CPU has no collectives across processes or threads, so here the device sums go through
the host; everything else (the launcher, signals, the data split, stop votes, the collective
checkpoint, failure handling) is the code a TPU runs. Each failure these tests inject is one a
one-replica run cannot show: a stop signal that reaches some replicas or processes only, a
master whose disk fails, a replica that dies, hosts that do not share their output_dir.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from finetuning_pipeline import main
from finetuning_pipeline.checkpointing import complete_checkpoints
from trainer_helpers import (LaunchedRun, Replicas, adapter_tensors, assert_same_run, metric_records,
                             prepare_demo_data, publish_to_hub_cache, train_losses, wait_for_step, write_run_config)

STEPS = 24
# 2 replicas x micro-batch 2 x 2 micro-batches: a global batch of 8 sequences. LoRA dropout on:
# a resumed run must draw every replica's masks again. The loss in chunks of 50 tokens (its
# While loop and hand-written backward; the tiny vocabulary would otherwise take one piece).
RUN = {"train": {"max_steps": STEPS, "micro_batch": 2, "grad_accum": 2, "loss_chunk_tokens": 50},
       "lora": {"dropout": 0.1},
       "checkpoint": {"every": 4, "keep": 3}, "logging": {"every": 1, "progress_bar": False, "tensorboard": False},
       "eval": {"every": 0, "max_batches": 2}}
HANG = 180  # seconds: a replica still running after this is hung
HUB_ID, HUB_COMMIT = "tiny-org/tiny-mistral", "c" * 40


@pytest.fixture(scope="module")
def data(tiny_model_dir, tmp_path_factory):
    return prepare_demo_data(tiny_model_dir, tmp_path_factory.mktemp("data"))


def config_for(root: Path, model_dir: Path, data, name: str = "run", **sections) -> Path:
    merged = {k: dict(v) for k, v in RUN.items()}
    for section, values in sections.items():
        merged.setdefault(section, {}).update(values)
    root.mkdir(parents=True, exist_ok=True)
    return write_run_config(root / f"{name}.yaml", model_dir, data, root / name, **merged)


def out_of(config: Path) -> Path:
    return config.parent / config.stem


def checkpoint_steps(out: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in complete_checkpoints(out / "phase1" / "checkpoints")]


def wait_for_replicas(replicas: Replicas, out: Path, step: int) -> int:
    return wait_for_step(replicas.procs, out, step, timeout=HANG, output=replicas.outputs)


def run_replicas(n: int, config: Path, log_dir: Path, *args: str, env: dict | None = None,
                 script: str = "finetuning_pipeline/main.py", rank_args=lambda rank: []) -> Replicas:
    return Replicas(n, ["--config", str(config), "--phase", "1", *args], log_dir, env, script, rank_args)


def launched(config: Path, log: Path, *args: str, devices: int = 2) -> LaunchedRun:
    """Phase 1 started the TPU host's way: one worker process with `devices` replica threads."""
    return LaunchedRun(["--config", str(config), "--phase", "1", *args], log, devices)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, data, tmp_path_factory):
    """An uninterrupted two-replica run of phase 1."""
    config = config_for(tmp_path_factory.mktemp("reference"), tiny_model_dir, data)
    replicas = run_replicas(2, config, config.parent / "logs")
    assert replicas.wait(HANG) == [0, 0], replicas.outputs()
    summary = json.loads((out_of(config) / "phase1" / "summary.json").read_text())
    assert summary["parallel"]["processes"] == 2 and summary["global_batch"] == 8
    assert summary["compiles_after_warmup"] == 0
    return out_of(config)


# -- the documented command: torchrun, equal to one replica with the same global batch ----------
def torchrun(replicas: int, config: Path, *args: str, script: str = "finetuning_pipeline/main.py",
             env: dict | None = None) -> None:
    """Run `script` (main.py or a patched_main) under torchrun."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(replicas),
         script, "--config", str(config), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PJRT_DEVICE": "CPU", **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def patched_main(root: Path, patch: str) -> str:
    """A script that runs main.py after `patch` (Python source that sees the trainer module as
    `trainer`) has changed the master's behaviour: a failure only a multi-replica run can show."""
    repo = Path(__file__).resolve().parent.parent
    script = root / "patched_main.py"
    script.write_text(f"import errno, os, runpy, sys, time\nsys.path.insert(0, {str(repo)!r})\n"
                      f"from finetuning_pipeline import trainer\n{patch}\n"
                      f"runpy.run_path({str(repo / 'finetuning_pipeline' / 'main.py')!r}, run_name='__main__')\n")
    return str(script)


# Phase 2 loads phase 1's adapter on every replica: a replica that went on without waiting for
# the master would find no adapter when the master is slow to write it (a race CI once lost).
SLOW_MASTER_ADAPTER = """
write = trainer.save_adapter
def late(*args, **kwargs):
    time.sleep(3)
    return write(*args, **kwargs)
trainer.save_adapter = late
"""


@pytest.fixture(scope="module")
def torchrun_and_single(tiny_model_dir, data, tmp_path_factory):
    """No dropout (its masks depend on the replica), the same global batch of 8: 2 replicas
    through torchrun (micro-batch 2, both phases, the master slow to write its adapters, W&B
    on, offline), 4 replicas (micro-batch 1, phase 1, the base named by a Hub id, read from a
    Hub-layout cache), and 1 replica (micro-batch 4)."""
    root = tmp_path_factory.mktemp("torchrun")
    common = {"train": {"max_steps": 6}, "lora": {"dropout": 0.0}, "checkpoint": {"every": 3, "keep": 3}}
    two = config_for(root, tiny_model_dir, data, "two", **common,
                     logging={"wandb": {"project": "tpu-lora-tests", "mode": "offline"}})
    four = config_for(root, tiny_model_dir, data, "four", **{**common, "train": {"max_steps": 6, "micro_batch": 1}},
                      model={"path": HUB_ID})
    one = config_for(root, tiny_model_dir, data, "one", **{**common, "train": {"max_steps": 6, "micro_batch": 4}})
    torchrun(2, two, script=patched_main(root, SLOW_MASTER_ADAPTER), env={"WANDB_SILENT": "true"})
    publish_to_hub_cache(root / "hub", HUB_ID, HUB_COMMIT, tiny_model_dir, "main")
    torchrun(4, four, "--phase", "1", env={"HF_HUB_CACHE": str(root / "hub")})
    assert main.main(["--config", str(one)]) == 0
    return out_of(two), out_of(one), one, out_of(four)


@pytest.mark.parametrize("replicas, phase", [(2, 1), (2, 2), (4, 1)])
def test_replicas_through_torchrun_equal_one_replica(torchrun_and_single, replicas, phase):
    two, one, _, four = torchrun_and_single
    several = two if replicas == 2 else four
    ours, single = metric_records(several, "train", phase), metric_records(one, "train", phase)
    assert [r["step"] for r in ours] == [r["step"] for r in single] == list(range(1, 7))
    for a, b in zip(ours, single):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["label_tokens"] == b["label_tokens"]  # the same blocks, split over two replicas
    for a, b in zip(metric_records(several, "eval", phase), metric_records(one, "eval", phase)):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    ours_adapter, single_adapter = adapter_tensors(several, phase), adapter_tensors(one, phase)
    for key in single_adapter:
        torch.testing.assert_close(ours_adapter[key], single_adapter[key], rtol=1e-3, atol=2e-4, msg=key)
    summary = json.loads((several / f"phase{phase}" / "summary.json").read_text())
    assert summary["parallel"]["processes"] == replicas and summary["global_batch"] == 8
    assert summary["compiles_after_warmup"] == 0


def test_replicas_share_one_wandb_run_per_phase_and_one_pinned_hub_commit(torchrun_and_single):
    """Only the master opens a W&B run; every replica trains the commit the Hub id resolved to
    (their losses equal one replica's on the same weights: test above)."""
    two, _, _, four = torchrun_and_single
    for phase in (1, 2):
        [run] = (two / f"phase{phase}" / "wandb").glob("offline-run-*")
        assert run.name.endswith((two / f"phase{phase}" / "wandb_run_id").read_text().strip())
    settings = json.loads((four / "phase1" / "summary.json").read_text())["settings"]
    assert settings["model.path"] == HUB_ID and settings["model.revision"] == HUB_COMMIT


def test_resume_on_another_number_of_chips_with_the_same_global_batch(torchrun_and_single, tmp_path, capsys):
    """A spot v6e-8 that comes back as something else: the two-replica run's step-3 checkpoint
    resumed by one replica with micro-batch 4 continues the same stream of global blocks."""
    two, _, one_config, _ = torchrun_and_single
    checkpoint = two / "phase1" / "checkpoints" / "step_00000003"
    out = tmp_path / "resumed"
    args = ["--config", str(one_config), "--phase", "1", "--resume", str(checkpoint), f"output_dir={out}"]
    assert main.main(args) == 0
    summary = json.loads((out / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3
    assert summary["resumed_on_other_chips"] == {"saved_on": 2, "resumed_on": 1}
    assert "saved on 2 chips, resuming on 1 with the same global batch of 8" in capsys.readouterr().out
    resumed, original = dict(train_losses(out)), dict(train_losses(two))
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(original[step], abs=1e-5)

    # Another global batch would be another run: refused, naming both values.
    assert main.main([*args[:-1], f"output_dir={tmp_path / 'other'}", "train.micro_batch=2"]) == 2
    err = capsys.readouterr().err
    assert "global batch of 8 sequences, this run has 4" in err


# -- stop requests --------------------------------------------------------------------------
def stopped_after(output: str, rank: int) -> int:
    """The step replica `rank` says it stopped after."""
    line = next(line for line in output.splitlines() if line.startswith(f"replica {rank}: stopped"))
    return int(line.split("after step ")[1].split()[0])


def stop_lines(replicas: Replicas) -> list[int]:
    """The step each replica process says it stopped after."""
    return [stopped_after(replicas.output(rank), rank) for rank in range(len(replicas.procs))]


def test_a_preempted_tpu_host_checkpoints_one_step_on_every_replica_and_resumes_exactly(tiny_model_dir, data,
                                                                                        reference, tmp_path):
    """A preempted VM signals every process: the launching one and its worker, whose two
    replicas run on worker threads (the TPU v2/v3 shape; torch_xla.launch would have caught no
    signal there). Both stop after the same step, one checkpoint, exit 0; the same command
    resumes, and the run equals the two-process torchrun run bitwise (threads of one process
    build the same LoRA init and draw their own dropout masks, as processes do)."""
    config = config_for(tmp_path, tiny_model_dir, data, checkpoint={"every": 0})  # only the stop writes one
    run = launched(config, tmp_path / "run.log")
    seen = wait_for_replicas(run, out_of(config), 3)
    for pid in (run.proc.pid, run.worker()):
        os.kill(pid, signal.SIGTERM)
    assert run.wait(HANG) == [0], run.output()
    stopped = checkpoint_steps(out_of(config))
    # The signal went out once step `seen` was logged; the replicas vote after every step, so
    # they stop after the step running then or the next (one more for the test's polling lag).
    assert len(stopped) == 1 and seen <= stopped[0] <= seen + 3 and stopped[0] < STEPS, (seen, stopped)
    assert [stopped_after(run.output(), rank) for rank in (0, 1)] == [stopped[0]] * 2
    assert "resume with:" in run.output() and "(SIGTERM)" in run.output()
    assert not (out_of(config) / "phase1" / "summary.json").exists()

    resumed = launched(config, tmp_path / "resumed.log")
    assert resumed.wait(HANG) == [0], resumed.output()
    summary = json.loads((out_of(config) / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped[0] and summary["parallel"]["processes"] == 2
    assert summary["compiles_after_warmup"] == 0
    assert_same_run(out_of(config), reference)


def test_a_signal_to_the_launching_process_alone_stops_its_replicas_with_a_checkpoint(tiny_model_dir, data, tmp_path):
    """Ctrl-C, or `kill PID` of the command a user started, on a v5e/v6e host's shape (a worker
    process per chip, its one replica on a worker thread): the launcher passes the signal on
    instead of dying first and leaving its workers behind."""
    config = config_for(tmp_path, tiny_model_dir, data, checkpoint={"every": 0}, lora={"dropout": 0.0})
    run = launched(config, tmp_path / "run.log", devices=1)
    wait_for_replicas(run, out_of(config), 2)
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(HANG) == [0], run.output()
    stopped = checkpoint_steps(out_of(config))
    assert len(stopped) == 1 and stopped[0] < STEPS and stopped_after(run.output(), 0) == stopped[0]
    assert "(SIGINT)" in run.output() and "Traceback" not in run.output()


def test_scanned_layers_on_two_replicas_stop_resume_and_take_the_layer_loops_steps(tiny_model_dir, data, reference,
                                                                                    tmp_path):
    """The scanned layers' hard case: two replicas, each its own LoRA dropout masks, the chunked
    loss's loop around the layers' loop, SIGTERM mid-run and a resume from the collective
    checkpoint (moments stored per layer): the steps of the layer loop's uninterrupted run."""
    config = config_for(tmp_path, tiny_model_dir, data, train={"scan_layers": True}, checkpoint={"every": 0})
    replicas = run_replicas(2, config, tmp_path / "logs")
    wait_for_replicas(replicas, out_of(config), 3)
    for proc in replicas.procs:
        proc.send_signal(signal.SIGTERM)
    assert replicas.wait(HANG) == [0, 0], replicas.outputs()
    stopped = checkpoint_steps(out_of(config))
    assert len(stopped) == 1 and stopped[0] < STEPS
    resumed = run_replicas(2, config, tmp_path / "logs-resumed")
    assert resumed.wait(HANG) == [0, 0], resumed.outputs()
    summary = json.loads((out_of(config) / "phase1" / "summary.json").read_text())
    assert summary["scanned_layers"] and summary["resumed_from_step"] == stopped[0]
    ours, theirs = train_losses(out_of(config)), train_losses(reference)
    assert [s for s, _ in ours] == [s for s, _ in theirs] == list(range(1, STEPS + 1))
    assert [loss for _, loss in ours] == pytest.approx([loss for _, loss in theirs], abs=1e-5)
    ours, theirs = adapter_tensors(out_of(config)), adapter_tensors(reference)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5, msg=key)


def test_sigterm_to_one_replica_stops_them_all_at_the_next_step(tiny_model_dir, data, reference, tmp_path):
    """A stray `kill` of one worker, with log steps rare (logging.every beyond the phase): the
    vote runs every step, not only on log steps, so the run still stops within a step or two."""
    config = config_for(tmp_path, tiny_model_dir, data, checkpoint={"every": 0}, logging={"every": 1000})
    replicas = run_replicas(2, config, tmp_path / "logs")
    wait_for_replicas(replicas, out_of(config), 1)  # step 1 is always logged
    replicas.procs[1].send_signal(signal.SIGTERM)  # not the master
    assert replicas.wait(HANG) == [0, 0], replicas.outputs()
    stopped = checkpoint_steps(out_of(config))
    assert len(stopped) == 1 and stopped[0] < STEPS // 2, stopped
    assert stop_lines(replicas) == [stopped[0]] * 2
    assert "replica 1: stopped after step" in replicas.output(1) and "(SIGTERM)" in replicas.output(1)

    resumed = run_replicas(2, config, tmp_path / "logs-resumed", "logging.every=1")
    assert resumed.wait(HANG) == [0, 0], resumed.outputs()
    ours, theirs = adapter_tensors(out_of(config)), adapter_tensors(reference)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    steps_after = [s for s, _ in train_losses(out_of(config)) if s > stopped[0]]
    assert dict(train_losses(out_of(config)))[STEPS] == dict(train_losses(reference))[STEPS] and steps_after


# -- failures -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["dp", "fsdp"])
def test_a_checkpoint_write_failing_on_the_master_stops_every_replica_with_exit_3(tiny_model_dir, data, tmp_path, mode):
    per_chip = {"train": {"max_steps": STEPS, "micro_batch": 1}} if mode == "fsdp" else {}
    config = config_for(tmp_path, tiny_model_dir, data, checkpoint={"every": 2}, parallel={"mode": mode}, **per_chip)
    blocked = out_of(config) / "phase1" / "checkpoints"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("a file where the checkpoints directory goes: every save fails on the master\n")
    replicas = run_replicas(2, config, tmp_path / "logs", env={"CPU_NUM_DEVICES": "2"} if mode == "fsdp" else None)
    assert replicas.wait(HANG) == [3, 3], replicas.outputs()
    assert "could not write checkpoint step 2" in replicas.output(0)
    assert "the master could not write checkpoint step 2" in replicas.output(1)
    assert "Traceback" not in replicas.outputs()


def test_a_checkpoint_write_failing_on_the_master_thread_stops_both_replica_threads_with_exit_3(tiny_model_dir, data,
                                                                                               tmp_path):
    """The same failure on a TPU v2/v3 host's shape: the replicas are threads of one process, so
    a failed one must take its host group down itself (nothing closes its sockets otherwise) and
    the launcher must report the master's error, not its peer's."""
    config = config_for(tmp_path, tiny_model_dir, data, checkpoint={"every": 2})
    blocked = out_of(config) / "phase1" / "checkpoints"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("a file where the checkpoints directory goes: every save fails on the master\n")
    run = launched(config, tmp_path / "run.log")
    assert run.wait(HANG) == [3], run.output()
    assert "could not write checkpoint step 2" in run.output() and "Traceback" not in run.output()


def test_an_adapter_write_failing_on_the_master_stops_every_replica_with_exit_3(tiny_model_dir, data, tmp_path):
    config = config_for(tmp_path, tiny_model_dir, data, train={"max_steps": 4}, checkpoint={"every": 2})
    full_disk = ("def full(model, directory, *args, **kwargs):\n"
                 "    raise OSError(errno.ENOSPC, 'No space left on device', str(directory))\n"
                 "trainer.save_adapter = full\n")
    replicas = run_replicas(2, config, tmp_path / "logs", "--phase", "all", script=patched_main(tmp_path, full_disk))
    assert replicas.wait(HANG) == [3, 3], replicas.outputs()
    adapter = out_of(config) / "phase1" / "adapter"
    assert f"cannot write {adapter}: No space left on device" in replicas.output(0)
    assert "The last intact checkpoint is" in replicas.output(0) and "step_00000004" in replicas.output(0)
    assert "the master could not write phase 1's adapter or summary" in replicas.output(1)  # not waiting forever
    assert "Traceback" not in replicas.outputs()
    assert not (out_of(config) / "phase2").exists()
    resumed = run_replicas(2, config, tmp_path / "resumed", "--resume", "auto")  # the advice, once the disk is fixed
    assert resumed.wait(HANG) == [0, 0], resumed.outputs()
    assert adapter_tensors(out_of(config), 1) and json.loads((adapter.parent / "summary.json").read_text())["steps"] == 4


@pytest.mark.parametrize("started_by", ["torchrun", "the TPU launcher"])
def test_a_killed_replica_stops_the_others_and_the_run_resumes(tiny_model_dir, data, reference, tmp_path, started_by):
    """SIGKILL (no handler runs): one of torchrun's processes, or the launcher's worker process
    (out of memory on a TPU host): the others stop at once, and the run resumes exactly."""
    config = config_for(tmp_path, tiny_model_dir, data)
    if started_by == "torchrun":
        replicas = run_replicas(2, config, tmp_path / "logs")
    else:
        replicas = launched(config, tmp_path / "run.log")
    wait_for_replicas(replicas, out_of(config), random.Random().randint(5, 14))
    victim = random.Random().randint(0, 1)
    started = time.time()
    if started_by == "torchrun":
        replicas.procs[victim].kill()
    else:
        os.kill(replicas.worker(), signal.SIGKILL)
    codes = replicas.wait(60)
    if started_by == "torchrun":
        assert codes[1 - victim] != 0, replicas.outputs()
    else:
        assert codes == [3] and "a replica process died" in replicas.output(), replicas.output()
    assert time.time() - started < 60
    checkpoints = checkpoint_steps(out_of(config))
    assert checkpoints

    resumed = run_replicas(2, config, tmp_path / "logs-resumed")
    assert resumed.wait(HANG) == [0, 0], resumed.outputs()
    summary = json.loads((out_of(config) / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == checkpoints[-1]
    assert_same_run(out_of(config), reference)


# -- hosts of a pod ---------------------------------------------------------------------------
def test_hosts_without_one_shared_output_dir_or_plan_stop_before_the_first_step(tiny_model_dir, data, tmp_path):
    """A pod whose hosts each write to their own disk: the master would checkpoint on its own,
    the others would start at step 0 after a preemption and find no phase-1 adapter. Refused on
    every host before a model is loaded, naming the shared storage to provide; so are hosts
    that were given different commands."""
    config = config_for(tmp_path, tiny_model_dir, data)
    own_disks = run_replicas(2, config, tmp_path / "logs",
                             rank_args=lambda rank: [f"output_dir={tmp_path / f'host{rank}'}"])
    assert own_disks.wait(HANG) == [2, 2], own_disks.outputs()
    for rank in (0, 1):
        assert "is not one directory shared by every host: replica 1 on" in own_disks.output(rank)
        assert "README: \"TPU pod\"" in own_disks.output(rank)
        assert not (tmp_path / f"host{rank}" / "phase1").exists()
    assert not list((tmp_path / "host0").glob(".shared-check-*"))  # the master's probe file is gone

    other_plans = run_replicas(2, config, tmp_path / "logs-plans", rank_args=lambda rank: ["--phase", "all"] * rank)
    assert other_plans.wait(HANG) == [2, 2], other_plans.outputs()
    for rank in (0, 1):
        assert "the replicas do not agree on what to run (replica 0 on" in other_plans.output(rank)
        assert "replica 1 on" in other_plans.output(rank) and "phase 2 from step 0" in other_plans.output(rank)
    assert not (out_of(config) / "phase1" / "metrics.jsonl").exists()


# -- fsdp with several hosts: one SPMD process per host, two virtual chips each -------------------
@pytest.fixture(scope="module")
def fsdp_runs(tiny_model_dir, data, tmp_path_factory):
    """Phase 1, no dropout: one dp replica (micro-batch 4) and two fsdp "hosts" of two chips
    each (micro-batch 1 per chip): the same global batch of 8."""
    root = tmp_path_factory.mktemp("fsdp-hosts")
    common = {"train": {"max_steps": 12}, "lora": {"dropout": 0.0}}
    single = config_for(root, tiny_model_dir, data, "single", **{**common, "train": {"max_steps": 12, "micro_batch": 4}})
    assert main.main(["--config", str(single), "--phase", "1"]) == 0
    fsdp = config_for(root, tiny_model_dir, data, "fsdp", **{**common, "train": {"max_steps": 12, "micro_batch": 1}},
                      parallel={"mode": "fsdp"})
    replicas = run_replicas(2, fsdp, root / "logs", env={"CPU_NUM_DEVICES": "2"})
    assert replicas.wait(HANG) == [0, 0], replicas.outputs()
    return out_of(single), out_of(fsdp), fsdp


def test_fsdp_on_two_hosts_equals_one_replica(fsdp_runs):
    single, fsdp, _ = fsdp_runs
    assert [s for s, _ in train_losses(fsdp)] == list(range(1, 13))
    for (_, ours), (_, theirs) in zip(train_losses(fsdp), train_losses(single)):
        assert ours == pytest.approx(theirs, abs=1e-5)
    summary = json.loads((fsdp / "phase1" / "summary.json").read_text())
    assert summary["parallel"]["processes"] == 2 and summary["parallel"]["chips"] == 4
    assert summary["parallel"]["mesh"] == {"data": 1, "fsdp": 2}
    assert summary["global_batch"] == 8 and summary["compiles_after_warmup"] == 0


def test_fsdp_hosts_stop_together_and_resume_exactly(fsdp_runs, tmp_path):
    _, reference, config = fsdp_runs
    stopped_config = tmp_path / "fsdp.yaml"
    stopped_config.write_text(config.read_text().replace(str(reference), str(tmp_path / "fsdp")))
    replicas = run_replicas(2, stopped_config, tmp_path / "logs", "checkpoint.every=0", env={"CPU_NUM_DEVICES": "2"})
    wait_for_replicas(replicas, tmp_path / "fsdp", 2)
    replicas.procs[1].send_signal(signal.SIGTERM)
    assert replicas.wait(HANG) == [0, 0], replicas.outputs()
    stopped = checkpoint_steps(tmp_path / "fsdp")
    assert len(stopped) == 1 and stop_lines(replicas) == [stopped[0]] * 2
    resumed = run_replicas(2, stopped_config, tmp_path / "logs-resumed", env={"CPU_NUM_DEVICES": "2"})
    assert resumed.wait(HANG) == [0, 0], resumed.outputs()
    assert_same_run(tmp_path / "fsdp", reference)
