"""Shared by the trainer tests: prepared tiny datasets, small run configs, runs in processes of
their own, and a loss poisoned on chosen steps."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
from pathlib import Path

import torch
import yaml

from dataset.prepare import PrepareOptions, prepare
from dataset.samples import ALPACA, CHAT_QA, DOMAIN_TEXT, PREFERENCE_PAIRS
from finetuning_pipeline.distributed.torchrun_agent import child_pids

SEQ_LEN = 64


def prepare_demo_data(tokenizer_dir: Path, root: Path) -> dict:
    """Phase-1 and phase-2 shards of the bundled corpora at SEQ_LEN ({1: ..., 2: ...}), and the
    bundled preference pairs ("pairs")."""
    inputs = {1: [DOMAIN_TEXT], 2: [CHAT_QA, ALPACA], "pairs": [PREFERENCE_PAIRS]}
    out = {}
    for phase, files in inputs.items():
        out[phase] = root / (f"phase{phase}" if isinstance(phase, int) else phase)
        prepare(PrepareOptions(inputs=[str(f) for f in files], tokenizer=str(tokenizer_dir), seq_len=SEQ_LEN,
                               out=str(out[phase]), quiet=True))
    return out


def write_run_config(path: Path, model_dir: Path, data: dict[int, Path], output_dir: Path, **sections) -> Path:
    """A small, fast run: 12 steps a phase, fp32, eval and checkpoints along the way."""
    config = {
        "output_dir": str(output_dir),
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"r": 8, "alpha": 16},
        # TPU_LORA_TEST_SEED: another seed for the margins across seeds (tests/tolerances.py)
        "train": {"max_steps": 12, "micro_batch": 4, "grad_accum": 2, "lr": 1e-2, "warmup_steps": 2,
                  "seed": int(os.environ.get("TPU_LORA_TEST_SEED", "0"))},
        "eval": {"every": 6, "max_batches": 4},
        "checkpoint": {"every": 4, "keep": 2},
        "logging": {"every": 3, "progress_bar": False, "tensorboard": True},
        "phase1": {"data": str(data[1])},
        "phase2": {"data": str(data[2]), "init": "continue"},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values
    path.write_text(yaml.safe_dump(config))
    return path


def train_in_fresh_process(config: Path, *args: str, env: dict | None = None):
    """main.py in a process of its own (a CompletedProcess): its XLA graph cache starts empty, so
    what it reports about compiles cannot depend on graphs another test compiled in this one."""
    import subprocess

    return subprocess.run([sys.executable, "finetuning_pipeline/main.py", "--config", str(config), *args],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PJRT_DEVICE": "CPU",
                                                                            **(env or {})})


def publish_to_hub_cache(cache: Path, repo_id: str, commit: str, files: Path, *refs: str) -> Path:
    """Put `files` in a Hugging Face cache laid out as the Hub writes it, as `repo_id` at
    `commit` (models--ORG--NAME/snapshots/COMMIT), and point each ref (refs/REF) at it."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files, snapshot, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def kill_choices(test: str) -> random.Random:
    """The random choices of a test that kills a run (the step, the victim), seeded so that a
    failure replays: by KILL_SEED (default 0) and the test's name. `KILL_SEED=7 make test`
    tries others; the seed is printed, so a failing run's log says how to replay it."""
    seed = int(os.environ.get("KILL_SEED", "0"))
    print(f"{test}: kill choices seeded by KILL_SEED={seed}")
    return random.Random(f"{seed}:{test}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replicas:
    """N trainer processes started with torchrun's environment contract (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID), each its own Popen, so a test can signal,
    kill and read every replica on its own. (`torchrun` itself is used where that is not needed.)"""

    def __init__(self, n: int, args: list[str], log_dir: Path, env: dict | None = None,
                 script: str = "finetuning_pipeline/main.py", rank_args=lambda rank: []) -> None:
        import subprocess

        port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.logs = [log_dir / f"rank{rank}.log" for rank in range(n)]
        self.procs = []
        for rank in range(n):
            replica_env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                           "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                           "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           "TORCHELASTIC_RUN_ID": "tests", **(env or {})}
            with open(self.logs[rank], "w") as log:
                self.procs.append(subprocess.Popen([sys.executable, script, *args, *rank_args(rank)],
                                                   stdout=log, stderr=subprocess.STDOUT, env=replica_env))

    def wait(self, timeout: float) -> list[int]:
        """Exit codes; a replica still running after `timeout` seconds is a test failure (a hang)."""
        import subprocess
        import time

        deadline = time.time() + timeout
        codes = []
        for rank, proc in enumerate(self.procs):
            try:
                codes.append(proc.wait(timeout=max(deadline - time.time(), 0.1)))
            except subprocess.TimeoutExpired:
                stacks_then_kill(self.procs)
                raise AssertionError(f"replica {rank} still running after {timeout} s (its threads' stacks at the "
                                     f"end):\n{self.outputs()}") from None
        return codes

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def outputs(self) -> str:
        return "\n".join(f"--- replica {r} ---\n{self.output(r)}" for r in range(len(self.procs)))

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class LaunchedRun:
    """`python finetuning_pipeline/main.py ... parallel.launcher=tpu` on a CPU: started the way a
    TPU host starts its replicas (launch.py), one launching process and one worker process with
    `devices` replica threads (2: the TPU v2/v3 shape). Quacks like Replicas (procs, wait,
    output, outputs), so the helpers below take either."""

    def __init__(self, args: list[str], log: Path, devices: int, env: dict | None = None) -> None:
        import subprocess

        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        run_env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                   "CPU_NUM_DEVICES": str(devices), "MASTER_PORT": str(free_port()), **(env or {})}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "finetuning_pipeline/main.py", *args, "parallel.launcher=tpu"],
                stdout=out, stderr=subprocess.STDOUT, env=run_env)
        self.procs = [self.proc]

    def worker(self, timeout: float = 60) -> int:
        return launcher_worker(self.proc.pid, timeout, self.output)

    def wait(self, timeout: float) -> list[int]:
        import subprocess

        try:
            return [self.proc.wait(timeout=timeout)]
        except subprocess.TimeoutExpired:
            stacks_then_kill(self.procs)
            raise AssertionError(f"the launched run still runs after {timeout} s (its processes' thread stacks at "
                                 f"the end):\n{self.output()}") from None

    def output(self, rank: int = 0) -> str:
        return self.log.read_text()

    def outputs(self) -> str:
        return self.output()


def startup_patch(root: Path, patch: str) -> dict:
    """The environment that runs `patch` (Python source) at the start of every Python process a
    run starts, the launcher's spawned workers too (a sitecustomize module on PYTHONPATH): how a
    test injects a fault into a replica the TPU launcher runs."""
    directory = root / "startup_patch"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(patch)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))}


def thread_kill(pid: int, tid: int, signum: int) -> None:
    """tgkill(2): `signum` to thread `tid` of process `pid` (os.kill lets the kernel choose the thread)."""
    import ctypes
    import platform

    number = {"x86_64": 234, "aarch64": 131}[platform.machine()]  # SYS_tgkill
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, tid, signum) != 0 and ctypes.get_errno() != 3:  # ESRCH: the thread has ended
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {signum})")


SIGNAL_NUMBERS = {int(sig) for sig in signal.Signals}


def thread_signals(pid: int, tid: int, field: str) -> set[signal.Signals] | None:
    """The signals in a thread's mask `field` of /proc: SigBlk (blocked) or SigPnd (pending on
    that thread); None once the thread has ended."""
    try:
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    except FileNotFoundError:
        return None
    for line in status.splitlines():
        if line.startswith(f"{field}:"):
            mask = int(line.split()[1], 16)
            return {signal.Signals(bit + 1) for bit in range(64) if mask >> bit & 1 and bit + 1 in SIGNAL_NUMBERS}
    raise KeyError(f"{field} not in /proc/{pid}/task/{tid}/status")


def launcher_worker(launcher: int, timeout: float = 60, output=lambda: "") -> int:
    """The pid of the worker process a launcher spawned (not multiprocessing's resource tracker)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in child_pids(launcher):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no worker process after {timeout} s:\n{output()}")


def process_alive(pid: int) -> bool:
    """Running (a zombie that nobody reaped yet has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stacks_then_kill(procs) -> None:
    """A hung run's last words: SIGABRT to each of its processes and their children, so each
    writes its threads' stacks into the log as it dies (utils/stack_dump.py: faulthandler,
    whatever its threads are blocked in), then SIGKILL to whatever is left."""
    import signal
    import time

    tree = [proc.pid for proc in procs]
    for pid in list(tree):
        tree += descendants(pid)
    for sig in (signal.SIGABRT, signal.SIGKILL):
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        time.sleep(3 if sig == signal.SIGABRT else 0)
    for proc in procs:
        proc.wait()


def descendants(pid: int) -> list[int]:
    found = []
    for child in child_pids(pid):
        found += [child, *descendants(child)]
    return found


# -- reading a run's outputs (the trainer's, the resume and the multi-replica tests) -----------
def metric_records(out: Path, kind: str = "train", phase: int = 1) -> list[dict]:
    import json

    path = out / f"phase{phase}" / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def train_losses(out: Path, phase: int = 1) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metric_records(out, "train", phase)]


def adapter_tensors(out: Path, phase: int = 1) -> dict:
    from safetensors.torch import load_file

    return load_file(out / f"phase{phase}" / "adapter" / "adapter_model.safetensors")


def assert_same_run(out: Path, reference: Path) -> None:
    """Phase 1 of `out` took the steps of `reference`: every logged loss and the adapter, bitwise."""
    import torch

    assert train_losses(out) == train_losses(reference)
    ours, theirs = adapter_tensors(out), adapter_tensors(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def wait_for_step(procs: list, out: Path, step: int, timeout: float, output=lambda: "") -> int:
    """The newest logged step of phase 1, once it is at least `step`; fails if a process
    exits first or the step is not reached in `timeout` seconds (killing the processes)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        seen = [s for s, _ in train_losses(out)]
        if seen and max(seen) >= step:
            return max(seen)
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"training exited early:\n{output()}")
        time.sleep(0.02)
    for p in procs:
        p.kill()
    raise AssertionError(f"step {step} not reached in {timeout} s:\n{output()}")


def poison_nan_in_steps(monkeypatch, steps: set[int], grad_accum: int, seed: int = 0, phase: int = 1,
                        group: int | None = None) -> None:
    """Make the loss NaN in the given (1-based) steps of one replica, with no new graph, in a
    step traced once as in one traced every step: the loss is poisoned where the micro-batch's
    first random draw (made before its dropout masks) is one of the draws those steps' seeds
    give (the trainer seeds each micro-batch, trainer.micro_batch_seeds), so the decision is
    data on the device. group: adapters side by side, poison only that adapter's loss."""
    import torch_xla.core.xla_model as xm

    import finetuning_pipeline.train.step as step_module
    from finetuning_pipeline.runtime.xla.device import init_xla_device
    from finetuning_pipeline.train.stepper import micro_batch_seeds

    device = init_xla_device()
    draws = []
    for step in steps:
        for micro_seed in micro_batch_seeds(seed, phase, 0, step - 1, grad_accum):
            xm.set_rng_state(micro_seed, device=device)
            draws.append(torch.rand(1, device=device))
    poisoned_draws = torch.cat(draws).cpu()
    real = step_module.causal_lm_loss_sum

    def poisoned(model, batch, packed=True, loss_chunk=0, groups=1):
        if not torch.is_grad_enabled():  # evaluation
            return real(model, batch, packed, loss_chunk, groups)
        draw = torch.rand(1, device=batch["input_ids"].device)  # first, before any dropout draws
        loss_sum, count = real(model, batch, packed, loss_chunk, groups)
        hit = (draw == poisoned_draws.to(loss_sum.device)).any()
        if group is not None:
            hit = hit & (torch.arange(groups) == group).to(loss_sum.device)
        factor = torch.where(hit, torch.tensor([float("nan")]).to(loss_sum.device),
                             torch.tensor([1.0]).to(loss_sum.device))
        return (loss_sum * factor).reshape(loss_sum.shape), count

    monkeypatch.setattr(step_module, "causal_lm_loss_sum", poisoned)


def run_preflight(tmp_path: Path, config: Path, *overrides: str, rehearse: bool = False) -> tuple[int, dict]:
    """`python -m finetuning_pipeline.preflight` in this process: its exit code and preflight.json."""
    args = ["--config", str(config), f"output_dir={tmp_path / 'out'}", *overrides]
    from finetuning_pipeline import preflight

    code = preflight.main(args if rehearse else ["--no-rehearsal", *args])
    report_path = tmp_path / "out" / "preflight.json"
    return code, json.loads(report_path.read_text()) if report_path.exists() else {}
