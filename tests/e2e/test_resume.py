"""Preemption and faults on real training runs: SIGTERM, SIGKILL, NaN, a failing disk, bad paths.

The promise under test: a run stopped at any moment resumes and finishes with exactly the
adapter (bitwise) and the per-step losses of an uninterrupted run.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import (
    adapter_tensors,
    assert_same_run,
    kill_choices,
    launcher_worker,
    poison_nan_in_steps,
    process_alive,
    startup_patch,
    train_losses,
    wait_for_step,
    write_run_config,
)

from finetuning_pipeline import main
from finetuning_pipeline.run.checkpointing import complete_checkpoints, verify_checkpoint

STEPS = 10
# LoRA dropout on: a resumed run must also draw the dropout masks the uninterrupted one drew.
RUN = {"train": {"max_steps": STEPS}, "checkpoint": {"every": 2, "keep": 3}, "logging": {"every": 1},
       "eval": {"every": 0, "max_batches": 2}, "lora": {"dropout": 0.1}}


def config_for(tmp_path, tiny_model_dir, data, **sections):
    merged = {k: dict(v) for k, v in RUN.items()}
    for section, values in sections.items():
        merged.setdefault(section, {}).update(values)
    return write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out", **merged)


def start(config: Path, env: dict | None = None) -> subprocess.Popen:
    """The run as a TPU host starts it (parallel.launcher=tpu): this launching process and a
    worker process whose one replica runs on a worker thread, the shape of each chip of a v5e."""
    return subprocess.Popen(
        [sys.executable, "finetuning_pipeline/main.py", "--config", str(config), "--phase", "1",
         "parallel.launcher=tpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU", "PYTHONUNBUFFERED": "1", "CPU_NUM_DEVICES": "1", **(env or {})},
    )


# Each step from step 3 on logs, then waits half a second: a step of the tiny model takes about
# 0.04 s, so without the wait the run could finish its last step before the SIGTERM sent on seeing
# step 3 reaches its replica (passed on by the launcher, which wakes every 0.2 s), on a loaded machine.
SLOW_FROM_STEP_3 = """
import time
from finetuning_pipeline.monitor import metrics_log
write = metrics_log.MetricsLog.write
def write_then_wait(self, record):
    write(self, record)
    if record["kind"] == "train" and record["step"] >= 3:
        time.sleep(0.5)
metrics_log.MetricsLog.write = write_then_wait
"""


def wait_for_step_of(proc: subprocess.Popen, out: Path, step: int) -> None:
    wait_for_step([proc], out, step, timeout=240, output=lambda: proc.stdout.read())


@pytest.fixture(scope="module")
def reference(tiny_model_dir, data, tmp_path_factory):
    """An uninterrupted run, in its own process like the interrupted ones."""
    root = tmp_path_factory.mktemp("reference")
    proc = start(config_for(root, tiny_model_dir, data))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    return root / "out"


def test_sigkill_at_a_random_step_then_resume_equals_the_uninterrupted_run(tiny_model_dir, data, reference, tmp_path):
    kill_at = kill_choices("sigkill then resume").randint(3, STEPS - 1)
    print(f"killing the run after step {kill_at}")
    config = config_for(tmp_path, tiny_model_dir, data)
    proc = start(config)
    wait_for_step_of(proc, tmp_path / "out", kill_at)
    os.kill(launcher_worker(proc.pid), signal.SIGKILL)  # the process that trains: no handler, no last checkpoint
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "a replica process died" in output, output
    checkpoints = complete_checkpoints(tmp_path / "out" / "phase1" / "checkpoints")
    assert checkpoints, f"killed at step {kill_at} before any checkpoint"
    assert main.main(["--config", str(config), "--phase", "1"]) == 0  # --resume auto
    summary = json.loads((tmp_path / "out" / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == int(checkpoints[-1].name.split("_")[1]), kill_at
    assert_same_run(tmp_path / "out", reference)


def test_a_stop_waits_for_two_queued_steps_at_most_not_for_all_the_host_ran_ahead(tiny_model_dir, data, tmp_path):
    """A preemption notice gives 30 s. Steps that are slow on the device (14 micro-batches of 8
    on the tiny model, about 0.1 s: 112 of the data's 117 training blocks) and a run that logs
    once, so that only the run-ahead bound makes the host wait: before it, the host had queued 32
    steps when SIGTERM came 2 s in, and the checkpoint was complete 32 step times after the
    signal. Step times are this run's own (from its first logged step to its checkpoint the device
    runs without a pause), so a loaded machine slows both sides of the comparison."""
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out",
                              train={"max_steps": 200, "micro_batch": 8, "grad_accum": 14}, eval={"every": 0},
                              checkpoint={"every": 0}, logging={"every": 1000, "tensorboard": False})
    proc = start(config)
    wait_for_step_of(proc, tmp_path / "out", 1)
    first_logged = time.monotonic()
    time.sleep(2)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    checkpoints = tmp_path / "out" / "phase1" / "checkpoints"
    while not complete_checkpoints(checkpoints) and proc.poll() is None:
        time.sleep(0.01)
    complete = time.monotonic()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "stopped on SIGTERM" in output, output
    stopped_at = int(complete_checkpoints(checkpoints)[0].name.split("_")[1])
    step_time = (complete - first_logged) / (stopped_at - 1)
    # Waited for: the step running at the signal, the one queued behind it, the step during
    # which the vote came, and the save (about one more step here).
    assert complete - signalled <= 6 * step_time, (complete - signalled, step_time, stopped_at)


def test_sigterm_checkpoints_at_the_next_step_and_exits_0(tiny_model_dir, data, reference, tmp_path):
    config = config_for(tmp_path, tiny_model_dir, data, checkpoint={"every": 0})  # only the one SIGTERM writes
    proc = start(config, env=startup_patch(tmp_path, SLOW_FROM_STEP_3))
    wait_for_step_of(proc, tmp_path / "out", 3)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    checkpoints = complete_checkpoints(tmp_path / "out" / "phase1" / "checkpoints")
    assert len(checkpoints) == 1
    stopped_at = int(checkpoints[0].name.split("_")[1])
    assert 3 <= stopped_at < STEPS
    assert f"stopped on SIGTERM after a checkpoint at step {stopped_at} of phase 1; resume with:" in output
    # pasted, it resumes on the devices the run had
    assert f"  PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 {sys.executable} finetuning_pipeline/main.py --config {config} " \
           "--phase 1 --resume auto parallel.launcher=tpu" in output
    assert not (tmp_path / "out" / "phase1" / "summary.json").exists()

    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    summary = json.loads((tmp_path / "out" / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped_at
    assert_same_run(tmp_path / "out", reference)


def test_a_killed_launcher_leaves_no_orphan_its_worker_checkpoints_and_stops(tiny_model_dir, data, tmp_path):
    """SIGKILL (or the OOM killer) of the command a user started, not of its worker: the worker
    would train on unwatched and keep the chips from the next run; it stops with a checkpoint
    instead (it looks for its launcher every second: a long run, so the kill lands mid-run),
    and the same command resumes from it."""
    steps = 300
    config = config_for(tmp_path, tiny_model_dir, data, train={"max_steps": steps}, checkpoint={"every": 0})
    proc = start(config)
    wait_for_step_of(proc, tmp_path / "out", 3)
    worker = launcher_worker(proc.pid)
    proc.kill()
    proc.wait()
    deadline = time.time() + 120
    while process_alive(worker) and time.time() < deadline:
        time.sleep(0.1)
    output = proc.stdout.read()
    assert not process_alive(worker), output
    checkpoints = complete_checkpoints(tmp_path / "out" / "phase1" / "checkpoints")
    assert len(checkpoints) == 1, output
    stopped = int(checkpoints[0].name.split("_")[1])
    assert 3 <= stopped < steps
    assert f"stopped on its launching process's exit after a checkpoint at step {stopped} of phase 1" in output
    assert "Traceback" not in output  # its report has nobody to read it: the worker still leaves cleanly
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    summary = json.loads((tmp_path / "out" / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped and summary["steps"] == steps


def test_nan_steps_are_skipped_on_device_and_counted(tiny_model_dir, data, tmp_path, monkeypatch):
    poison_nan_in_steps(monkeypatch, steps={3}, grad_accum=2)
    config = config_for(tmp_path, tiny_model_dir, data, train={"max_steps": 6, "max_bad_steps": 2})
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    summary = json.loads((tmp_path / "out" / "phase1" / "summary.json").read_text())
    assert summary["skipped_steps"] == 1
    records = [json.loads(line) for line in (tmp_path / "out" / "phase1" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records if r["kind"] == "train"}
    assert by_step[2]["skipped_steps"] == 0 and by_step[3]["skipped_steps"] == 1
    assert torch.isnan(torch.tensor(by_step[3]["loss"]))
    assert all(torch.isfinite(t).all() for t in adapter_tensors(tmp_path / "out").values())
    assert summary["compiles_after_warmup"] == 0  # the poisoned step ran the same graph


def test_too_many_bad_steps_stop_the_run_keeping_the_last_good_checkpoint(tiny_model_dir, data, tmp_path,
                                                                         monkeypatch, capsys):
    poison_nan_in_steps(monkeypatch, steps=set(range(5, 100)), grad_accum=2)
    config = config_for(tmp_path, tiny_model_dir, data, train={"max_steps": 10, "max_bad_steps": 2})
    assert main.main(["--config", str(config), "--phase", "1"]) == 3
    err = capsys.readouterr().err
    assert "2 consecutive steps had a non-finite loss or gradient norm (train.max_bad_steps=2)" in err
    latest = complete_checkpoints(tmp_path / "out" / "phase1" / "checkpoints")[-1]
    assert f"Last good checkpoint: {latest}" in err
    assert latest.name == "step_00000004"  # the check runs before step 6's checkpoint: no skipped step saved
    verify_checkpoint(latest)
    assert all(torch.isfinite(t).all() for t in load_file(latest / "adapter_model.safetensors").values())
    assert not (tmp_path / "out" / "phase1" / "summary.json").exists()
    assert not (tmp_path / "out" / "phase1" / "adapter").exists()
    # The message's advice works: with the poison gone and a lower LR, --resume auto
    # --accept-changes continues from the last good checkpoint, recorded as no longer exact.
    assert "--resume auto --accept-changes" in err
    monkeypatch.undo()
    assert main.main(["--config", str(config), "--phase", "1", "train.lr=0.005"]) == 2
    assert "continue anyway with --accept-changes" in capsys.readouterr().err
    assert main.main(["--config", str(config), "--phase", "1", "--accept-changes", "lora.r=4", "train.lr=0.005"]) == 2
    assert "cannot continue under another lora.r (8 -> 4)" in capsys.readouterr().err
    assert main.main(["--config", str(config), "--phase", "1", "--accept-changes", "train.lr=0.005"]) == 0
    assert "the run is no longer the one an uninterrupted run would give" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["resumed_with_changes"] == {"train.lr": [0.01, 0.005]}
    assert summary["skipped_steps"] == 0 and all(
        torch.isfinite(t).all() for t in adapter_tensors(tmp_path / "out").values()
    )


def test_a_failing_disk_at_save_time_keeps_the_step_elsewhere_and_the_run_resumes_from_it(tiny_model_dir, data,
                                                                                          reference, tmp_path,
                                                                                          monkeypatch, capsys):
    """The output disk refuses checkpoint step 4: the run stops (exit 3), step 4's checkpoint is
    written under the temporary directory instead, and resuming from it finishes the run exactly."""
    import tempfile

    import finetuning_pipeline.run.checkpointing as ckpt

    real_save = torch.save
    saves = {"n": 0}

    def full_disk(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            saves["n"] += 1
            if saves["n"] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    config = config_for(tmp_path, tiny_model_dir, data)
    assert main.main(["--config", str(config), "--phase", "1"]) == 3
    err = capsys.readouterr().err
    root = tmp_path / "out" / "phase1" / "checkpoints"
    [rescued] = (tmp_path / "tmp").glob("rescued-phase1-checkpoint-*/step_00000004")
    assert f"could not write checkpoint step 4 under {root}: No space left on device. It was written to {rescued} " \
           f"instead, so no step is lost: free space (or fix permissions) and rerun with --resume {rescued}" in err
    assert [p.name for p in root.iterdir()] == ["step_00000002"]  # no half-written step 4 left behind
    verify_checkpoint(rescued)

    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert main.main(["--config", str(config), "--phase", "1", "--resume", str(rescued)]) == 0
    assert json.loads((tmp_path / "out" / "phase1" / "summary.json").read_text())["resumed_from_step"] == 4
    assert_same_run(tmp_path / "out", reference)


def test_outputs_that_fail_to_write_at_the_end_are_written_by_the_resume(tiny_model_dir, data, reference, tmp_path,
                                                                         monkeypatch, capsys):
    """The final checkpoint is written, the summary is not: the resume takes no step, writes the
    adapter and summary of the uninterrupted run, and logs the final evaluation once."""
    import finetuning_pipeline.train.phase_loop as phase_loop
    from finetuning_pipeline.monitor.metrics_log import read_metrics

    real_write = phase_loop.atomic_write_json

    def read_only(path, value):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(phase_loop, "atomic_write_json", read_only)
    config = config_for(tmp_path, tiny_model_dir, data)
    out = tmp_path / "out"
    assert main.main(["--config", str(config), "--phase", "1"]) == 3
    assert "Read-only file system" in capsys.readouterr().err and not (out / "phase1" / "summary.json").exists()

    monkeypatch.setattr(phase_loop, "atomic_write_json", real_write)
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"phase 1: {STEPS} steps, eval loss " in printed and "tokens/s" not in printed
    assert f"(every step was taken before this resume from step {STEPS}; this run evaluated and wrote the " \
           "outputs)" in printed
    assert json.loads((out / "phase1" / "summary.json").read_text())["resumed_from_step"] == STEPS
    assert_same_run(out, reference)
    evals = [r for r in read_metrics(out / "phase1" / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals == [r for r in read_metrics(reference / "phase1" / "metrics.jsonl") if r["kind"] == "eval"]


def test_a_disk_that_refuses_every_checkpoint_names_the_last_intact_one(tiny_model_dir, data, tmp_path, monkeypatch,
                                                                        capsys):
    import tempfile

    import finetuning_pipeline.run.checkpointing as ckpt

    real_save = torch.save
    saves = {"n": 0}

    def full_disks(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            saves["n"] += 1
            if saves["n"] >= 2:  # the output disk's step 4 and the temporary directory's
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", full_disks)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    config = config_for(tmp_path, tiny_model_dir, data, train={"max_steps": 4})
    assert main.main(["--config", str(config), "--phase", "1"]) == 3
    err = capsys.readouterr().err
    root = tmp_path / "out" / "phase1" / "checkpoints"
    assert f"nor under {tmp_path / 'tmp'}. The previous checkpoint {root / 'step_00000002'} is intact" in err
    assert [p.name for p in root.iterdir()] == ["step_00000002"] and not any((tmp_path / "tmp").iterdir())
    verify_checkpoint(root / "step_00000002")


def test_bad_resume_paths_and_changed_settings(tiny_model_dir, data, reference, tmp_path, capsys):
    config = config_for(tmp_path, tiny_model_dir, data)
    assert main.main(["--config", str(config), "--resume", str(tmp_path / "nowhere")]) == 2
    assert "--resume:" in capsys.readouterr().err
    checkpoint = complete_checkpoints(reference / "phase1" / "checkpoints")[0]
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in checkpoint.iterdir():
        if f.name != "COMPLETE":
            (partial / f.name).write_bytes(f.read_bytes())
    assert main.main(["--config", str(config), "--resume", str(partial)]) == 2
    assert "incomplete checkpoint" in capsys.readouterr().err
    assert main.main(["--config", str(config), "--resume", str(reference / "phase1" / "adapter")]) == 2
    assert f"{reference / 'phase1' / 'adapter'}: an adapter, not a checkpoint" in capsys.readouterr().err
    assert main.main(["--config", str(config), "--resume", str(tmp_path)]) == 2
    assert f"--resume: {tmp_path}: not a checkpoint (a checkpoint is a directory OUTPUT_DIR/phaseN/checkpoints/" \
           in capsys.readouterr().err
    assert main.main(["--config", str(config), "--resume", str(checkpoint), "train.lr=0.5", "lora.r=4"]) == 2
    err = capsys.readouterr().err
    assert "was saved under other settings" in err and "lora.r: 8 -> 4" in err and "train.lr: 0.01 -> 0.5" in err


def test_a_base_that_moved_resumes_and_other_weights_at_its_path_are_refused(tiny_model_dir, data, reference,
                                                                          tmp_path, capsys):
    """A resume matches the base by its weights, as lineage.json does, not by its path:
    the base copied elsewhere (a run's directories may move) resumes the checkpoint and finishes the
    uninterrupted run bitwise; other weights at that path are refused, naming them."""
    from safetensors.torch import save_file

    moved = tmp_path / "moved" / "base"
    shutil.copytree(tiny_model_dir, moved)
    config = config_for(tmp_path, moved, data)
    checkpoint = complete_checkpoints(reference / "phase1" / "checkpoints")[-2]
    assert main.main(["--config", str(config), "--phase", "1", "--resume", str(checkpoint)]) == 0, \
        capsys.readouterr().err
    resumed_at = int(checkpoint.name.split("_")[1])
    assert train_losses(tmp_path / "out") == [(s, loss) for s, loss in train_losses(reference) if s > resumed_at]
    ours, theirs = adapter_tensors(tmp_path / "out"), adapter_tensors(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    weights = load_file(moved / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-2
    save_file(weights, moved / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "other").mkdir()
    other = config_for(tmp_path / "other", moved, data)
    capsys.readouterr()
    assert main.main(["--config", str(other), "--phase", "1", "--resume", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert "model.weights: 'sha256:" in err and f"the files in {moved} are not the base the checkpoint" in err


def test_a_session_budget_checkpoints_exits_0_and_the_next_session_continues(tiny_model_dir, data, reference,
                                                                             tmp_path, monkeypatch, capsys):
    """train.max_wall_time on a clock that advances one second per step: with 10 s, the budget
    ends the first session after step 8 (8 s spent + twice the slowest step > 10 - 1); the same
    command then finishes the phase, bitwise equal to an uninterrupted run."""
    import itertools

    class OneSecondPerStep(main.WallClockBudget):
        def __init__(self, seconds, started, **kwargs):
            ticks = itertools.count(1)
            super().__init__(seconds, 0.0, clock=lambda: float(next(ticks)), **kwargs)

    monkeypatch.setattr(main, "WallClockBudget", OneSecondPerStep)
    config = config_for(tmp_path, tiny_model_dir, data, train={"max_wall_time": "10s"}, checkpoint={"every": 0})
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    out = capsys.readouterr().out
    assert ("stopped before the session budget (train.max_wall_time=10s) ran out, after a checkpoint at step 8 of "
            "phase 1; the next session continues with the same command:") in out
    assert [p.name for p in complete_checkpoints(tmp_path / "out" / "phase1" / "checkpoints")] == ["step_00000008"]
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    assert json.loads((tmp_path / "out" / "phase1" / "summary.json").read_text())["resumed_from_step"] == 8
    assert_same_run(tmp_path / "out", reference)





def corrupt(checkpoint: Path, how: str) -> str:
    """Damage one file of a checkpoint as a failing disk or a killed copy would; returns its name."""
    name = {"flipped byte": "adapter_model.safetensors", "truncated file": "optimizer.pt",
            "truncated trainer_state.json": "trainer_state.json", "truncated COMPLETE": "COMPLETE"}[how]
    path = checkpoint / name
    data = bytearray(path.read_bytes())
    if how == "flipped byte":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    return name


def unfinished_copy(reference: Path, tmp_path: Path) -> Path:
    """The reference run as if it had been stopped after its last checkpoint (step 10)."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    (out / "phase1" / "summary.json").unlink()
    shutil.rmtree(out / "phase1" / "adapter")
    return out


@pytest.mark.parametrize("how", ["flipped byte", "truncated file", "truncated trainer_state.json",
                                 "truncated COMPLETE"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(how, tiny_model_dir, data, reference,
                                                                         tmp_path, capsys):
    out = unfinished_copy(reference, tmp_path)
    checkpoints = out / "phase1" / "checkpoints"
    damaged = corrupt(checkpoints / "step_00000010", how)
    config = config_for(tmp_path, tiny_model_dir, data)
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"warning: skipping checkpoint step_00000010: {checkpoints / 'step_00000010' / damaged}" in printed
    assert f"phase 1: resuming from step 8 ({checkpoints / 'step_00000008'})" in printed
    assert "phase 1 step 9/10: loss " in printed  # no progress bar here: a line per log step
    summary = json.loads((out / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 8
    assert_same_run(out, reference)  # steps 9 and 10 redone exactly
    verify_checkpoint(checkpoints / "step_00000010")  # and their checkpoint written anew


def test_no_intact_checkpoint_is_refused_not_restarted_silently(tiny_model_dir, data, reference, tmp_path, capsys):
    out = unfinished_copy(reference, tmp_path)
    for checkpoint in complete_checkpoints(out / "phase1" / "checkpoints"):
        corrupt(checkpoint, "flipped byte")
    config = config_for(tmp_path, tiny_model_dir, data)
    assert main.main(["--config", str(config), "--phase", "1"]) == 2
    err = capsys.readouterr().err
    assert "--resume auto: no intact checkpoint under" in err and "--phase 1 --resume never --force" in err
    assert not (out / "phase1" / "summary.json").exists()


def test_a_disk_that_turns_read_only_mid_run_exits_3_naming_the_last_checkpoint(tiny_model_dir, data, tmp_path,
                                                                                monkeypatch, capsys):
    from finetuning_pipeline.monitor.metrics_log import MetricsLog

    real_write = MetricsLog.write

    def read_only_after_step_5(self, record):
        if record["step"] > 5:
            raise OSError(errno.EROFS, "Read-only file system", str(self.path))
        return real_write(self, record)

    monkeypatch.setattr(MetricsLog, "write", read_only_after_step_5)
    config = config_for(tmp_path, tiny_model_dir, data)
    assert main.main(["--config", str(config), "--phase", "1"]) == 3
    err = capsys.readouterr().err
    metrics = tmp_path / "out" / "phase1" / "metrics.jsonl"
    latest = tmp_path / "out" / "phase1" / "checkpoints" / "step_00000004"
    assert f"error: cannot write {metrics}: Read-only file system. The last intact checkpoint is {latest}" in err
    assert "rerun with --resume auto" in err and "Traceback" not in err
    verify_checkpoint(latest)


def test_a_data_shard_that_fails_to_read_mid_run_exits_3_naming_it(tiny_model_dir, data, tmp_path, monkeypatch,
                                                                    capsys):
    """The reader runs on MpDeviceLoader's thread, which swallows its exceptions and ends the
    iteration: the trainer hands the error over to the training thread (no StopIteration
    traceback, no hang)."""
    from dataset.loader import ShardLoader

    real_next = ShardLoader.next_batch
    shard = data[1] / "train" / "input_ids.npy"

    def failing_disk(self):
        if self.position >= 5 * self.micro_batch * 2:  # the batches of step 6 onwards (grad_accum 2)
            raise OSError(errno.EIO, "Input/output error", str(shard))
        return real_next(self)

    monkeypatch.setattr(ShardLoader, "next_batch", failing_disk)
    config = config_for(tmp_path, tiny_model_dir, data)
    assert main.main(["--config", str(config), "--phase", "1"]) == 3
    err = capsys.readouterr().err
    latest = tmp_path / "out" / "phase1" / "checkpoints" / "step_00000004"
    assert f"error: cannot access {shard}: Input/output error. The last intact checkpoint is {latest}" in err
    assert "Traceback" not in err and "StopIteration" not in err


def test_a_second_command_on_a_run_that_holds_its_output_dir_is_refused_before_saying_it_resumes(
        tiny_model_dir, data, tmp_path, capsys):
    """A run in progress (here: its lock held) and the same command started again (a user who thinks
    it died, or its torchrun's orphans still training): refused in one line, exit 2, and nothing of
    the plan ("phase 1: resuming from step 2") said first; once the lock is free it resumes."""
    from finetuning_pipeline.run.run_layout import OutputLock, RunLayout

    config = config_for(tmp_path, tiny_model_dir, data, train={"max_steps": 4})
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    phase = tmp_path / "out" / "phase1"  # made unfinished: its checkpoint at step 2 the newest
    (phase / "summary.json").unlink()
    shutil.rmtree(phase / "checkpoints" / "step_00000004")
    capsys.readouterr()
    held = OutputLock(RunLayout(tmp_path / "out"))
    held.acquire()
    try:
        assert main.main(["--config", str(config), "--phase", "1"]) == 2
    finally:
        held.release()
    said = capsys.readouterr()
    assert "is in use by another run" in said.err and "resuming" not in said.out, said
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    assert "phase 1: resuming from step 2" in capsys.readouterr().out
