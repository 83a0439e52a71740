"""The native runtime's processes started by torchrun: parallel.mode=dp, each a replica whose
LoRA gradients DistributedDataParallel sums (runtime/native/ddp.py), and parallel.mode=fsdp,
each holding a shard of every decoder layer's frozen weights (FSDP2: runtime/native/fsdp.py);
their loss sums and host decisions go through torch.distributed (gloo on a CPU). Each equals in
float64 one process with the same global batch of 8 sequences (micro-batch 4, 2 or 1, two
micro-batches a step): dp over 2 processes and both demo phases, 4 processes, adapters side by
side, a q8_0 base with recomputed layers and the chunked loss, a preference (DPO) phase; fsdp over
2 processes and both phases, 1x4 and 2x2 meshes, adapters side by side with selectively recomputed
layers, a q8_0 base, a preference phase. LoRA dropout is on (0.1): each sequence draws its masks
from its place in the global stream, whichever process and micro-batch hold it.
Then what the XLA runtime's processes are held to: a SIGTERM to one or to all (dp and fsdp)
stops all with one checkpoint and the run resumes bitwise; a killed one stops the other, naming it; a checkpoint
resumes on fewer processes with the same global batch; processes that disagree on the plan stop
before their first step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO
from native_helpers import NATIVE, assert_runs_equal, sections_with, side_by_side
from replica_helpers import (
    HANG,
    STEPS,
    checkpoint_steps,
    config_for,
    out_of,
    run_replicas,
    stop_lines,
    torchrun,
    wait_for_replicas,
)
from tolerances import assert_equal_in_exact_arithmetic
from trainer_helpers import (
    adapter_tensors,
    assert_same_run,
    child_pids,
    process_alive,
    thread_kill,
    thread_signals,
    train_losses,
    wait_for_step,
    write_run_config,
)

from finetuning_pipeline import main
from finetuning_pipeline.distributed.stop_relay import catches_stop_signals

pytestmark = pytest.mark.native

FSDP = {"parallel": {"mode": "fsdp"}}
CASES = {  # name: (processes, --phase, the sections that differ)
    "dp_curriculum_2": (2, "all", lambda data: {}),
    "dp_4": (4, "1", lambda data: {}),
    "dp_side_by_side_2": (2, "1", side_by_side),
    "dp_q8_0_recomputed_2": (2, "1", lambda data: {"model": {"dtype": "float64", "quantize": "q8_0",
                                                             "activation_checkpointing": True}}),
    "fsdp_curriculum_2": (2, "all", lambda data: FSDP),
    "fsdp_1x4": (4, "1", lambda data: FSDP),
    "fsdp_2x2": (4, "1", lambda data: {"parallel": {"mode": "fsdp", "mesh": {"data": 2, "fsdp": 2}}}),
    "fsdp_side_by_side_2_recomputed": (2, "1", lambda data: {**side_by_side(data), **FSDP, "model": {
        "dtype": "float64", "activation_checkpointing": "selective"}}),
    "fsdp_q8_0_2": (2, "1", lambda data: {**FSDP, "model": {"dtype": "float64", "quantize": "q8_0"}}),
    "fsdp_nf4_recomputed_1x4": (4, "1", lambda data: {**FSDP, "model": {"dtype": "float64", "quantize": "nf4",
                                                                         "activation_checkpointing": True}}),
    # A preference phase (DPO, its reference the base): the pairs' loss sums, pair counts and metric
    # sums through DDP's wrapped objective and the replicas' sums.
    "dp_preference_2": (2, "1", lambda data: {"phase1": {"data": str(data["pairs"])}}),
    "fsdp_preference_2": (2, "1", lambda data: {**FSDP, "phase1": {"data": str(data["pairs"])}}),
}


def config(root, tiny_model_dir, data, name: str, micro_batch: int, extra: dict):
    train = {"micro_batch": micro_batch, **({"loss_chunk_tokens": 64} if "model" in extra else {})}
    if name == "one":  # one process: dp (fsdp over one process shards nothing)
        extra = {k: v for k, v in extra.items() if k != "parallel"}
    sections = sections_with(**{**extra, "train": train})  # (LoRA dropout 0.1: native_helpers.SMALL)
    return write_run_config(root / f"{name}.yaml", tiny_model_dir, data, root / name, **sections)


ONE_PROCESS: dict[str, Path] = {}  # the single-process runs, by their config and phases


def one_process_run(extra: dict, phases: str, tiny_model_dir, data, tmp_path_factory) -> Path:
    """The one-process run the cases compare with, trained once per test session for each config
    and phases (dp and fsdp cases of the same sections share it: over one process they are the
    same run)."""
    root = tmp_path_factory.mktemp("one")
    one = config(root, tiny_model_dir, data, "one", 4, extra)
    key = json.dumps([phases, {k: v for k, v in yaml.safe_load(one.read_text()).items() if k != "output_dir"}],
                     sort_keys=True)
    if key not in ONE_PROCESS:
        assert main.main(["--config", str(one), "--phase", phases, *NATIVE]) == 0
        ONE_PROCESS[key] = root / "one"
    return ONE_PROCESS[key]


@pytest.mark.parametrize("case", list(CASES))
def test_processes_under_torchrun_equal_one_process(case, tiny_model_dir, data, tmp_path, tmp_path_factory):
    processes, phases, extra = CASES[case]
    one = one_process_run(extra(data), phases, tiny_model_dir, data, tmp_path_factory)
    several = config(tmp_path, tiny_model_dir, data, "several", 4 // processes, extra(data))
    torchrun(processes, several, "--phase", phases, *NATIVE)
    assert_runs_equal(tmp_path / "several", one, [1, 2] if phases == "all" else [1])
    summary = json.loads((tmp_path / "several" / "phase1" / "summary.json").read_text())
    assert summary["parallel"]["processes"] == processes and summary["global_batch"] == 8
    if case.startswith("fsdp"):  # every decoder layer's frozen weights: 7 matrices and 2 norms
        layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
        # (a quantized base's: 7 codes and 7 scales held as FSDP2's parameters, and the 2 norms)
        quantized = "q8_0" in case or "nf4" in case
        assert summary["parallel"]["sharded_base_parameters"] == (16 if quantized else 9) * layers
        assert summary["parallel"]["mesh"] == ({"data": 2, "fsdp": 2} if case == "fsdp_2x2"
                                               else {"data": 1, "fsdp": processes})


# -- stops and failures: torchrun's processes, one Popen each (replica_helpers.run_replicas) ------
REFERENCES: dict[str, object] = {}


def reference_run(mode: str, tiny_model_dir, data, tmp_path_factory):
    """An uninterrupted run of phase 1 on two native processes under parallel.mode (LoRA dropout on:
    a resumed run draws every replica's masks again), once per test session and mode."""
    if mode not in REFERENCES:
        config = config_for(tmp_path_factory.mktemp(f"reference-{mode}"), tiny_model_dir, data,
                            model={"dtype": "float64"}, parallel={"mode": mode})
        replicas = run_replicas(2, config, config.parent / "logs", *NATIVE)
        assert replicas.wait(HANG) == [0, 0], replicas.outputs()
        REFERENCES[mode] = out_of(config)
    return REFERENCES[mode]


@pytest.fixture
def reference(tiny_model_dir, data, tmp_path_factory):
    return reference_run("dp", tiny_model_dir, data, tmp_path_factory)


@pytest.mark.parametrize("mode,signalled", [("dp", [1]), ("dp", [0, 1]), ("fsdp", [0, 1])])
def test_sigterm_stops_every_process_with_one_checkpoint_and_the_run_resumes_bitwise(
        mode, signalled, tiny_model_dir, data, tmp_path_factory, tmp_path):
    """SIGTERM to one process (not the master), or to every one (a preempted VM, torchrun passing
    it on): all stop at one step with one checkpoint, exit 0; resumed, the run ends bitwise as
    the uninterrupted one did."""
    reference = reference_run(mode, tiny_model_dir, data, tmp_path_factory)
    config = config_for(tmp_path, tiny_model_dir, data, model={"dtype": "float64"}, checkpoint={"every": 0},
                        parallel={"mode": mode})
    replicas = run_replicas(2, config, tmp_path / "logs", *NATIVE)
    wait_for_replicas(replicas, out_of(config), 3)
    for rank in signalled:
        replicas.procs[rank].send_signal(signal.SIGTERM)
    assert replicas.wait(HANG) == [0, 0], replicas.outputs()
    stopped = checkpoint_steps(out_of(config))
    assert len(stopped) == 1 and stop_lines(replicas) == [stopped[0]] * 2 and stopped[0] < STEPS
    resumed = run_replicas(2, config, tmp_path / "logs-resumed", *NATIVE)
    assert resumed.wait(HANG) == [0, 0], resumed.outputs()
    ours, theirs = adapter_tensors(out_of(config)), adapter_tensors(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in theirs)
    assert dict(train_losses(out_of(config)))[STEPS] == dict(train_losses(reference))[STEPS]


def test_torchrun_killed_leaves_no_process_and_its_printed_command_resumes_the_run(tiny_model_dir, data, reference,
                                                                                  tmp_path):
    """SIGKILL to torchrun itself (the OOM killer, kill -9 on the user's command): its processes, re-parented,
    stop as on SIGTERM with one checkpoint, none trains on; the resume command the master printed, pasted
    as a user would (torchrun with its process count), finishes the run bitwise as the uninterrupted one."""
    config = config_for(tmp_path, tiny_model_dir, data, model={"dtype": "float64"}, checkpoint={"every": 0})
    log = tmp_path / "torchrun.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "finetuning_pipeline/main.py", "--config", str(config), "--phase", "1", *NATIVE]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as output:
        proc = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    wait_for_step([proc], out_of(config), 3, timeout=HANG, output=log.read_text)
    workers = child_pids(proc.pid)
    assert len(workers) == 2, log.read_text()
    proc.kill()
    proc.wait()
    deadline = time.time() + HANG
    while any(process_alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.2)
    text = log.read_text()
    assert not any(process_alive(pid) for pid in workers), text
    stopped = checkpoint_steps(out_of(config))
    assert len(stopped) == 1 and stopped[0] < STEPS, text
    assert f"stopped on torchrun's exit after a checkpoint at step {stopped[0]} of phase 1; resume with:" in text
    printed = text.split("resume with:\n")[1].splitlines()[0].strip()
    assert " -m torch.distributed.run --standalone --nproc-per-node 2 finetuning_pipeline/main.py --config " in printed
    resumed = subprocess.run(printed, shell=True, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert json.loads((out_of(config) / "phase1" / "summary.json").read_text())["resumed_from_step"] == stopped[0]
    ours, theirs = adapter_tensors(out_of(config)), adapter_tensors(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in theirs)


def main_running_torchruns_agent(config: Path, log: Path, *args: str) -> subprocess.Popen:
    """`main.py --nproc-per-node 2`: torchrun's agent run by main.py itself (distributed/torchrun_agent.py)."""
    command = [sys.executable, "finetuning_pipeline/main.py", "--nproc-per-node", "2", "--config", str(config),
               "--phase", "1", *NATIVE, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as output:
        return subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def test_main_running_torchruns_agent_stops_on_sigint_with_exit_0_and_its_printed_command_resumes(
        tiny_model_dir, data, reference, tmp_path):
    """SIGINT (Ctrl-C) to `main.py --nproc-per-node 2`: its processes, each in a session of its own
    (torchrun's), get it from main.py, checkpoint one step and exit 0, and so does main.py, with
    none of torchrun's tracebacks; the resume command printed is main.py's own, which, pasted,
    finishes the run bitwise as the uninterrupted one."""
    config = config_for(tmp_path, tiny_model_dir, data, model={"dtype": "float64"}, checkpoint={"every": 0})
    log = tmp_path / "main.log"
    proc = main_running_torchruns_agent(config, log)
    wait_for_step([proc], out_of(config), 3, timeout=HANG, output=log.read_text)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(HANG) == 0, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text and "SignalException" not in text, text
    stopped = checkpoint_steps(out_of(config))
    assert len(stopped) == 1 and stop_lines_in(text) == [stopped[0]] * 2 and stopped[0] < STEPS, text
    printed = text.split("resume with:\n")[1].splitlines()[0].strip()
    assert "finetuning_pipeline/main.py --config " in printed and " --nproc-per-node 2 " in printed, printed
    assert "torch.distributed.run" not in printed, printed
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    resumed = subprocess.run(printed, shell=True, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert json.loads((out_of(config) / "phase1" / "summary.json").read_text())["resumed_from_step"] == stopped[0]
    ours, theirs = adapter_tensors(out_of(config)), adapter_tensors(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in theirs)


START_UP_MOMENTS = {  # when main.py --nproc-per-node 2 is stopped, and how the test knows it is there
    "before its processes exist": lambda proc, out: catches_stop_signals(proc.pid),  # (main.py imports)
    "while its processes import": lambda proc, out: bool(child_pids(proc.pid)),
    "before the first step": lambda proc, out: (out / "phase1").exists(),  # (the master's start of phase 1)
}


@pytest.mark.parametrize("moment", list(START_UP_MOMENTS))
def test_main_running_torchruns_agent_stopped_during_start_up_says_one_line_and_leaves_no_process(
        moment, tiny_model_dir, data, tmp_path):
    """Ctrl-C to `main.py --nproc-per-node 2` as it starts: exit 0, one line, no traceback or
    error line, no process left, and a checkpoint named only where one exists. (A stop before
    its processes existed was lost, the run trained every step; one while they imported was a
    KeyboardInterrupt traceback in each and a resume from a checkpoint that did not exist.)"""
    config = config_for(tmp_path, tiny_model_dir, data, model={"dtype": "float64"})
    out, log = out_of(config), tmp_path / "main.log"
    proc = main_running_torchruns_agent(config, log)
    deadline = time.monotonic() + HANG
    while not START_UP_MOMENTS[moment](proc, out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(HANG) == 0, log.read_text()
    text = log.read_text()
    assert not re.search(r"Traceback|KeyboardInterrupt|^error:", text, re.MULTILINE), text
    (line,) = [line for line in text.splitlines() if line.startswith("stopped on")]
    checkpoints = checkpoint_steps(out)
    if moment == "before its processes exist":
        assert line.startswith("stopped on SIGINT before the run's 2 processes were started: nothing was trained"), text
        assert not (out / "phase1").exists()
    elif moment == "while its processes import" or not checkpoints:  # (the last may reach step 1 first)
        assert line.startswith("stopped on SIGINT before the first step of phase 1: nothing of it was trained and "
                               "no checkpoint written"), text
        assert not checkpoints and not (out / "phase1" / "summary.json").exists()
    else:
        assert line.startswith(f"stopped on SIGINT after a checkpoint at step {checkpoints[-1]} of phase 1"), text
    assert "--resume auto" in text.split(line + "\n")[1].splitlines()[0]
    assert not running_with(str(config)), text  # no orphan: every process of the run has exited


def running_with(argument: str) -> list[int]:
    """The processes whose command line holds `argument`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if argument in cmdline.read_bytes().decode(errors="replace").split("\0"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def stop_lines_in(text: str) -> list[int]:
    return sorted(int(line.split("stopped after step ")[1].split()[0]) for line in text.splitlines()
                  if line.startswith("replica ") and "stopped after step " in line)


def test_main_running_torchruns_agent_says_a_refusal_once_and_a_killed_process_by_its_rank(
        tiny_model_dir, data, reference, tmp_path):
    """The same processes refusing a plan (an existing run restarted with --resume never and no
    --force): one line, exit 2. One process SIGKILLed mid-run: one line naming it, exit 3; none of
    torchrun's ChildFailedError block either time."""
    config = config_for(tmp_path, tiny_model_dir, data, model={"dtype": "float64"})
    log = tmp_path / "main.log"
    proc = main_running_torchruns_agent(config, log)
    wait_for_step([proc], out_of(config), 3, timeout=HANG, output=log.read_text)
    workers = child_pids(proc.pid)
    assert len(workers) == 2, log.read_text()
    os.kill(workers[1], signal.SIGKILL)
    assert proc.wait(HANG) == 3, log.read_text()
    said = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    assert len(said) == 1 and re.fullmatch(r"error: process [01] of 2 was killed by SIGKILL; the run resumes from "
                                           r"its last complete checkpoint with --resume auto", said[0]), said
    assert "ChildFailedError" not in log.read_text() and "Traceback" not in log.read_text(), log.read_text()
    refused = main_running_torchruns_agent(config, tmp_path / "refused.log", "--resume", "never")
    assert refused.wait(HANG) == 2, (tmp_path / "refused.log").read_text()
    text = (tmp_path / "refused.log").read_text()
    said = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "--force" in said[0] and "ChildFailedError" not in text, text


def test_a_killed_process_stops_the_other_in_bounded_time_naming_it_and_the_run_resumes(tiny_model_dir, data, reference,
                                                                             tmp_path):
    config = config_for(tmp_path, tiny_model_dir, data, model={"dtype": "float64"})
    replicas = run_replicas(2, config, tmp_path / "logs", *NATIVE)
    wait_for_replicas(replicas, out_of(config), 9)
    started = time.time()
    replicas.procs[1].kill()  # SIGKILL: no handler runs
    codes = replicas.wait(60)
    assert codes[0] != 0 and time.time() - started < 60, replicas.outputs()
    said = [line for line in replicas.output(0).splitlines() if "another replica stopped answering" in line]
    # one line, naming the rank (gloo's own message runs on for lines of its call sites)
    assert len(said) == 1 and said[0].startswith("error: replica 0: another replica stopped answering"), said
    assert said[0].endswith("with --resume auto") and "\nAt:" not in replicas.output(0), replicas.output(0)
    checkpoints = checkpoint_steps(out_of(config))
    resumed = run_replicas(2, config, tmp_path / "logs-resumed", *NATIVE)
    assert resumed.wait(HANG) == [0, 0], resumed.outputs()
    assert json.loads((out_of(config) / "phase1" / "summary.json").read_text())["resumed_from_step"] == checkpoints[-1]
    assert_same_run(out_of(config), reference)


def test_a_checkpoint_of_two_processes_resumes_on_one_with_the_same_global_batch(tiny_model_dir, data, tmp_path,
                                                                                 capsys):
    """A spot VM that comes back smaller: the two processes' step-3 checkpoint, resumed by one
    process with micro-batch 4, continues their run; another global batch is refused by name."""
    two = config(tmp_path, tiny_model_dir, data, "two", 2, {})
    torchrun(2, two, "--phase", "1", *NATIVE)
    one = config(tmp_path, tiny_model_dir, data, "one", 4, {})
    checkpoint = tmp_path / "two" / "phase1" / "checkpoints" / "step_00000003"
    args = ["--config", str(one), "--phase", "1", "--resume", str(checkpoint), *NATIVE]
    assert main.main(args) == 0
    summary = json.loads((tmp_path / "one" / "phase1" / "summary.json").read_text())
    assert summary["resumed_on_other_chips"] == {"saved_on": 2, "resumed_on": 1}
    resumed, original = dict(train_losses(tmp_path / "one")), dict(train_losses(tmp_path / "two"))
    assert sorted(resumed) == [4, 5, 6]
    assert_equal_in_exact_arithmetic([resumed[s] for s in (4, 5, 6)], [original[s] for s in (4, 5, 6)],
                                     "losses resumed on one process")
    capsys.readouterr()
    assert main.main([*args, f"output_dir={tmp_path / 'other'}", "train.micro_batch=2"]) == 2
    assert "global batch of 8 sequences, this run has 4" in capsys.readouterr().err


def test_processes_that_disagree_on_the_plan_all_stop_before_the_first_step(tiny_model_dir, data, tmp_path):
    config = config_for(tmp_path, tiny_model_dir, data, model={"dtype": "float64"})
    replicas = run_replicas(2, config, tmp_path / "logs", *NATIVE, rank_args=lambda rank: ["--phase", "all"] * rank)
    assert replicas.wait(HANG) == [2, 2], replicas.outputs()
    for rank in (0, 1):
        assert "the replicas do not agree on what to run (replica 0 on" in replicas.output(rank)
        assert "replica 1 on" in replicas.output(rank) and "phase 2 from step 0" in replicas.output(rank)
    assert not (out_of(config) / "phase1" / "metrics.jsonl").exists()


def test_a_processs_other_threads_leave_the_stop_signals_to_its_main_thread(tiny_model_dir, data, tmp_path):
    """The native process runs its replica on a thread started with the stop signals blocked
    (run/stop_signal.py), so gloo's, autograd's and every other thread it starts block them too:
    SIGTERM sent to each of them for 1.5 s stays pending there and does nothing, and the one sent
    to the process reaches its main thread, which stops both processes with a checkpoint."""
    config = config_for(tmp_path, tiny_model_dir, data, checkpoint={"every": 0}, lora={"dropout": 0.0},
                        train={"max_steps": 400})
    replicas = run_replicas(2, config, tmp_path / "logs", *NATIVE)
    seen = wait_for_replicas(replicas, out_of(config), 3)
    pid = replicas.procs[1].pid
    threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid]
    assert len(threads) >= 2  # the replica's thread and gloo's at least
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    assert not thread_signals(pid, pid, "SigBlk") & stop_signals
    for tid in threads:
        blocked = thread_signals(pid, tid, "SigBlk")
        assert blocked is None or blocked >= stop_signals, tid  # (None: the thread has ended)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        for tid in threads:
            thread_kill(pid, tid, signal.SIGTERM)
        time.sleep(0.002)
    assert [p.poll() for p in replicas.procs] == [None, None], replicas.outputs()
    replicas.procs[1].send_signal(signal.SIGTERM)
    assert replicas.wait(HANG) == [0, 0], replicas.outputs()
    stopped = checkpoint_steps(out_of(config))
    assert len(stopped) == 1 and seen <= stopped[0] < 400 and stop_lines(replicas) == [stopped[0]] * 2
