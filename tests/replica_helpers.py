"""Shared by the multi-replica tests (tests/e2e/test_multi_replica.py, test_replica_failures.py):
their run config, and replicas started by torchrun, one Popen per replica, or the TPU host's launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from trainer_helpers import (
    LaunchedRun,
    Replicas,
    wait_for_step,
    write_run_config,
)

from finetuning_pipeline.run.checkpointing import complete_checkpoints

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


def launched(config: Path, log: Path, *args: str, devices: int = 2, env: dict | None = None) -> LaunchedRun:
    """Phase 1 started the TPU host's way: one worker process with `devices` replica threads."""
    return LaunchedRun(["--config", str(config), "--phase", "1", *args], log, devices, env)


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
    """A script that runs main.py after `patch` (Python source that sees the phase loop module as
    `trainer`) has changed the master's behaviour: a failure only a multi-replica run can show."""
    repo = REPO
    script = root / "patched_main.py"
    script.write_text(f"import errno, os, runpy, sys, time\nsys.path.insert(0, {str(repo)!r})\n"
                      f"from finetuning_pipeline.train import phase_loop as trainer\n{patch}\n"
                      f"runpy.run_path({str(repo / 'finetuning_pipeline' / 'main.py')!r}, run_name='__main__')\n")
    return str(script)


def stopped_after(output: str, rank: int) -> int:
    """The step replica `rank` says it stopped after."""
    lines = [line for line in output.splitlines() if line.startswith(f"replica {rank}: stopped")]
    assert len(lines) == 1, f"replica {rank}'s stop line, once, at the start of a line, in:\n{output}"
    return int(lines[0].split("after step ")[1].split()[0])


def stop_lines(replicas: Replicas) -> list[int]:
    """The step each replica process says it stopped after."""
    return [stopped_after(replicas.output(rank), rank) for rank in range(len(replicas.procs))]
