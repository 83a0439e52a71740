"""`python main.py` with no --config, as users type it on a TPU VM."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def test_without_config_the_embedded_default_runs_from_any_directory(tiny_model_dir, data, tmp_path):
    """`python main.py` as users type it on a TPU VM, from finetuning_pipeline/: the demo
    config, its paths anchored at the repository (here overridden to the test's inputs, so
    nothing is built), and a resume command that chooses it again."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TPU_LORA_CONFIG"}
    done = subprocess.run(
        [sys.executable, "main.py", "--phase", "1", f"model.path={tiny_model_dir}", f"phase1.data={data[1]}",
         f"output_dir={out}", "train.max_steps=3", "train.micro_batch=2", "eval.every=0", "eval.max_batches=1",
         "checkpoint.every=0", "logging.progress_bar=false", "train.max_wall_time=1s"],
        cwd=REPO / "finetuning_pipeline", env={**env, "PJRT_DEVICE": "CPU"}, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    default = REPO / "finetuning_pipeline" / "configs" / "demo.yaml"
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"config: {default} (the embedded default: no --config given")
    # runtime.backend=auto, said with why: PJRT_DEVICE is set, so the XLA runtime, as a TPU would run
    assert lines[1] == "runtime: xla on PJRT_DEVICE=CPU (runtime.backend=auto and PJRT_DEVICE=CPU is set)"
    assert "building the embedded default" not in done.stdout
    # The budget ran out after step 1: the printed command resumes without --config, as given.
    resume = done.stdout.split("the next session continues with the same command:\n")[1].splitlines()[0]
    assert "--config" not in resume and "main.py --phase 1 --resume auto" in resume
    assert (out / "phase1" / "checkpoints").is_dir()
