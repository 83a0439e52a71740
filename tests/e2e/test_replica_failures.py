"""Several replicas on a CPU that stop, fail and resume: a stop signal that reaches some
replicas or processes only, a master whose disk fails, a replica that dies, hosts that do not
share their output_dir. Started the way a TPU host starts them (parallel.launcher=tpu) or as
torchrun processes; see test_multi_replica.py for what a CPU can and cannot show here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from replica_helpers import (
    HANG,
    STEPS,
    checkpoint_steps,
    config_for,
    launched,
    out_of,
    patched_main,
    run_replicas,
    stop_lines,
    stopped_after,
    wait_for_replicas,
)
from tolerances import assert_equal_in_exact_arithmetic
from trainer_helpers import (
    adapter_tensors,
    assert_same_run,
    kill_choices,
    process_alive,
    startup_patch,
    thread_kill,
    thread_signals,
    train_losses,
)


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



# -- stop requests --------------------------------------------------------------------------
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
    os.kill(run.worker(), signal.SIGUSR1)  # kill -USR1: the worker's threads' stacks, and it carries on
    for pid in (run.proc.pid, run.worker()):
        os.kill(pid, signal.SIGTERM)
    assert run.wait(HANG) == [0], run.output()
    assert len(re.findall(r" in run_replica$", run.output(), re.MULTILINE)) == 2, run.output()  # both threads' stacks
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


def test_a_workers_other_threads_leave_the_stop_signals_to_its_main_thread(tiny_model_dir, data, tmp_path):
    """The kernel hands a signal sent to a process to any of its threads that does not block it.
    Python runs the handler on the main thread whichever took it, but a C++ runtime thread
    (XLA's, gloo's) that takes one has its system call interrupted: SIGTERM sent to a worker's
    threads one by one aborted it with a corrupted heap in 1 run of 17 here and once in CI, and
    SIGINT sent to every thread for 1.5 s in 3 runs of 6. Every thread of a worker but its main
    one blocks SIGTERM, SIGINT and SIGUSR1: sent to them, the signal stays pending there and does
    nothing, and the one sent to the process reaches the main thread, which stops the replicas
    at the next step with a checkpoint."""
    steps = 400  # (still training after the barrage)
    config = config_for(tmp_path, tiny_model_dir, data, checkpoint={"every": 0}, lora={"dropout": 0.0},
                        train={"max_steps": steps})
    run = launched(config, tmp_path / "run.log")
    seen = wait_for_replicas(run, out_of(config), 3)
    worker = run.worker()
    threads = [int(tid) for tid in os.listdir(f"/proc/{worker}/task") if int(tid) != worker]
    assert len(threads) >= 2  # the replica threads at least
    stop_signals = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}
    assert not thread_signals(worker, worker, "SigBlk") & stop_signals
    for tid in threads:
        blocked = thread_signals(worker, tid, "SigBlk")
        assert blocked is None or blocked >= stop_signals, tid  # (None: the thread has ended)
    deadline = time.monotonic() + 1.5  # (the barrage that aborted 3 runs of 6 without the mask)
    while time.monotonic() < deadline:
        for tid in threads:
            thread_kill(worker, tid, signal.SIGTERM)
        time.sleep(0.002)
    pending = [tid for tid in threads if signal.SIGTERM in (thread_signals(worker, tid, "SigPnd") or ())]
    assert pending, "tgkill to a thread that blocks SIGTERM leaves it pending there"
    assert process_alive(worker) and run.proc.poll() is None, run.output()
    os.kill(worker, signal.SIGTERM)
    assert run.wait(HANG) == [0], run.output()
    stopped = checkpoint_steps(out_of(config))
    assert len(stopped) == 1 and seen <= stopped[0] < steps, (seen, stopped, run.output())
    assert [stopped_after(run.output(), rank) for rank in (0, 1)] == [stopped[0]] * 2


# Replica 0 fails at its step-2 checkpoint; replica 1 then waits forever: the stand-in for a
# device all-reduce whose dead peer never answers (on a CPU the sums go through gloo, whose
# closed group would end it at once).
FAILED_AND_BLOCKED = """
import time
from finetuning_pipeline.errors import CheckpointWriteError
from finetuning_pipeline.run import checkpointing
save = checkpointing.Checkpointer.save
def failing_or_blocked(self, step, **parts):
    if step == 2:
        import torch_xla.runtime as xr
        if xr.global_ordinal() == 0:
            raise CheckpointWriteError("injected: replica 0 fails at step 2")
        time.sleep(3600)
    return save(self, step, **parts)
checkpointing.Checkpointer.save = failing_or_blocked
"""


def test_a_failed_replica_whose_peer_never_returns_ends_the_run_in_bounded_time(tiny_model_dir, data, tmp_path):
    from finetuning_pipeline.runtime.xla.launch import FAILURE_GRACE_S

    config = config_for(tmp_path, tiny_model_dir, data, checkpoint={"every": 2})
    run = launched(config, tmp_path / "run.log", env=startup_patch(tmp_path, FAILED_AND_BLOCKED))
    worker = run.worker()
    assert run.wait(FAILURE_GRACE_S + HANG) == [3], run.output()
    assert "injected: replica 0 fails at step 2" in run.output() and "Traceback" not in run.output()
    assert not process_alive(worker)


def test_a_signal_to_the_launching_process_alone_stops_its_replicas_with_a_checkpoint(tiny_model_dir, data, tmp_path):
    """Ctrl-C, or `kill PID` of the command a user started, on a v5e/v6e host's shape (a worker
    process per chip, its one replica on a worker thread): the launcher passes the signal on
    instead of dying first and leaving its workers behind. The launching process trains nothing
    and on a CPU never loads torch_xla (launch.HiddenTorchXla; a TPU host's counts its chips with
    it); its worker, which trains, does."""
    config = config_for(tmp_path, tiny_model_dir, data, checkpoint={"every": 0}, lora={"dropout": 0.0})
    run = launched(config, tmp_path / "run.log", devices=1)
    wait_for_replicas(run, out_of(config), 2)
    launcher, worker = run.proc.pid, run.worker()
    loaded = {pid: "_XLAC" in Path(f"/proc/{pid}/maps").read_text() for pid in (launcher, worker)}
    assert loaded == {launcher: False, worker: True}, run.output()
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(HANG) == [0], run.output()
    stopped = checkpoint_steps(out_of(config))
    assert len(stopped) == 1 and stopped[0] < STEPS and stopped_after(run.output(), 0) == stopped[0]
    assert "(SIGINT)" in run.output() and "Traceback" not in run.output()


def test_a_signal_to_the_launching_process_while_its_worker_starts_stops_both_replicas_before_a_step(
        tiny_model_dir, data, tmp_path):
    """The same Ctrl-C while the worker process is still starting (spawned, importing torch): the
    launcher passes it on once the worker catches it (distributed/stop_relay.py; before, SIGINT
    there was a KeyboardInterrupt traceback mid-import), and the worker's two replica threads vote
    it before their first step: one line, exit 0, nothing trained, no checkpoint, no process left."""
    config = config_for(tmp_path, tiny_model_dir, data)
    run = launched(config, tmp_path / "run.log", devices=2)
    worker = run.worker()  # (it exists: it is importing)
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(HANG) == [0], run.output()
    output = run.output()
    assert [line for line in output.splitlines() if line.startswith("stopped on")] == [
        "stopped on SIGINT before the first step of phase 1: nothing of it was trained and no checkpoint written; "
        "the same command starts it:"], output
    assert "Traceback" not in output and "replica 0: stopped" not in output and not checkpoint_steps(out_of(config))
    assert not process_alive(worker)


def test_scanned_layers_on_two_replicas_stop_resume_and_take_the_layer_loops_steps(tiny_model_dir, data, tmp_path):
    """The scanned layers' hard case: two replicas, each its own LoRA dropout masks, the chunked
    loss's loop around the layers' loop, SIGTERM mid-run and a resume from the collective
    checkpoint (moments stored per layer): the steps of the layer loop's uninterrupted run. Both
    in float64: scanned and looped layers are equal in exact arithmetic (tests/tolerances.py)."""
    float64 = {"dtype": "float64"}
    loop = config_for(tmp_path / "loop", tiny_model_dir, data, model=float64)
    uninterrupted = run_replicas(2, loop, tmp_path / "logs-loop")
    assert uninterrupted.wait(HANG) == [0, 0], uninterrupted.outputs()
    config = config_for(tmp_path, tiny_model_dir, data, train={"scan_layers": True}, checkpoint={"every": 0},
                        model=float64)
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
    ours, theirs = train_losses(out_of(config)), train_losses(out_of(loop))
    assert [s for s, _ in ours] == [s for s, _ in theirs] == list(range(1, STEPS + 1))
    assert_equal_in_exact_arithmetic([loss for _, loss in ours], [loss for _, loss in theirs], "losses")
    ours, theirs = adapter_tensors(out_of(config)), adapter_tensors(out_of(loop))
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert_equal_in_exact_arithmetic(ours[key], theirs[key], key)


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
    # the master rescues the step under the system's temporary directory: this test's, not /tmp
    temporary = {"TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    replicas = run_replicas(2, config, tmp_path / "logs",
                            env={**temporary, "CPU_NUM_DEVICES": "2"} if mode == "fsdp" else temporary)
    assert replicas.wait(HANG) == [3, 3], replicas.outputs()
    [rescued] = (tmp_path / "tmp").glob("rescued-phase1-checkpoint-*/step_00000002")
    assert f"could not write checkpoint step 2 under {blocked}" in replicas.output(0)
    assert f"It was written to {rescued} instead" in replicas.output(0)
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
    (tmp_path / "tmp").mkdir()  # where the master rescues the step: this test's, not /tmp
    run = launched(config, tmp_path / "run.log", env={"TMPDIR": str(tmp_path / "tmp")})
    assert run.wait(HANG) == [3], run.output()
    assert "could not write checkpoint step 2" in run.output() and "Traceback" not in run.output()
    assert list((tmp_path / "tmp").glob("rescued-phase1-checkpoint-*/step_00000002"))


def test_an_adapter_write_failing_on_the_master_stops_every_replica_with_exit_3(tiny_model_dir, data, tmp_path):
    config = config_for(tmp_path, tiny_model_dir, data, train={"max_steps": 4}, checkpoint={"every": 2})
    full_disk = ("def full(model, directories, *args, **kwargs):  # {adapter: its directory}\n"
                 "    raise OSError(errno.ENOSPC, 'No space left on device', str(next(iter(directories.values()))))\n"
                 "trainer.save_adapters = full\n")
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
    assert (
        adapter_tensors(out_of(config), 1) and json.loads((adapter.parent / "summary.json").read_text())["steps"] == 4
    )


@pytest.mark.parametrize("started_by", ["torchrun", "the TPU launcher"])
def test_a_killed_replica_stops_the_others_and_the_run_resumes(tiny_model_dir, data, reference, tmp_path, started_by):
    """SIGKILL (no handler runs): one of torchrun's processes, or the launcher's worker process
    (out of memory on a TPU host): the others stop at once, and the run resumes exactly."""
    config = config_for(tmp_path, tiny_model_dir, data)
    if started_by == "torchrun":
        replicas = run_replicas(2, config, tmp_path / "logs")
    else:
        replicas = launched(config, tmp_path / "run.log")
    choices = kill_choices(f"killed replica, {started_by}")
    kill_at, victim = choices.randint(5, 14), choices.randint(0, 1)
    print(f"killing replica {victim} after step {kill_at}")
    wait_for_replicas(replicas, out_of(config), kill_at)
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
        assert "docs/tpu.md: \"On a TPU pod\"" in own_disks.output(rank)
        assert not (tmp_path / f"host{rank}" / "phase1").exists()
    assert not list((tmp_path / "host0").glob(".shared-check-*"))  # the master's probe file is gone

    other_plans = run_replicas(2, config, tmp_path / "logs-plans", rank_args=lambda rank: ["--phase", "all"] * rank)
    assert other_plans.wait(HANG) == [2, 2], other_plans.outputs()
    for rank in (0, 1):
        assert "the replicas do not agree on what to run (replica 0 on" in other_plans.output(rank)
        assert "replica 1 on" in other_plans.output(rank) and "phase 2 from step 0" in other_plans.output(rank)
    assert not (out_of(config) / "phase1" / "metrics.jsonl").exists()


