"""`make bench-stop`: from a stop signal to a complete checkpoint, with steps slow on the device.

    python -m benchmarks.stop_latency_bench [--runs 3] [--grad-accum 16]

A spot VM's preemption notice gives 30 seconds. The demo's tiny Mistral trains phase 1 the TPU
host's way (parallel.launcher=tpu, one replica thread) with 16 micro-batches of 8 a step, so that
the device, not the host, sets the pace, and logs once: nothing but the run-ahead bound
(finetuning_pipeline/train/run_ahead.py) keeps the host from queueing steps. SIGTERM goes out 2 s
after the first step is logged; the figure is the time until the checkpoint's COMPLETE marker
exists, in seconds and in step times (this run's own: from its first logged step to its
checkpoint the device runs without a pause). Results: the "stop_latency" section of
outputs/bench/bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.results import update_results
from finetuning_pipeline.run.checkpointing import complete_checkpoints

REPO = Path(__file__).resolve().parent.parent
SIGNAL_AFTER_S = 2.0


def write_inputs(root: Path) -> tuple[Path, Path]:
    """The demo's tiny model and its domain text prepared at 64 tokens a block."""
    from dataset.prepare import PrepareOptions, prepare
    from dataset.samples import DOMAIN_TEXT
    from finetuning_pipeline.demo.tiny_model import write_tiny_model

    model = write_tiny_model(root / "model", seed=0, log=lambda *_: None)
    prepare(PrepareOptions(inputs=[str(DOMAIN_TEXT)], tokenizer=str(model), seq_len=64, out=str(root / "data"),
                           quiet=True))
    return model, root / "data"


def one_stop(root: Path, model: Path, data: Path, grad_accum: int) -> dict:
    out = root / f"run{time.time_ns()}"
    config = root / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(out), "model": {"path": str(model), "dtype": "float32"},
        "train": {"max_steps": 1000, "micro_batch": 8, "grad_accum": grad_accum, "lr": 1e-3},
        "eval": {"every": 0}, "checkpoint": {"every": 0},
        "logging": {"every": 10_000, "progress_bar": False, "tensorboard": False},
        "phase1": {"data": str(data)}}))
    proc = subprocess.Popen([sys.executable, "finetuning_pipeline/main.py", "--config", str(config), "--phase", "1",
                             "parallel.launcher=tpu"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"})
    metrics = out / "phase1" / "metrics.jsonl"
    while not (metrics.is_file() and '"kind": "train"' in metrics.read_text()):
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before its first step: exit {proc.returncode} ({config})")
        time.sleep(0.01)
    first_logged = time.monotonic()
    time.sleep(SIGNAL_AFTER_S)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    checkpoints = out / "phase1" / "checkpoints"
    while not complete_checkpoints(checkpoints) and proc.poll() is None:
        time.sleep(0.005)
    complete = time.monotonic()
    proc.wait(timeout=300)
    stopped_at = int(complete_checkpoints(checkpoints)[0].name.split("_")[1])
    step_time = (complete - first_logged) / (stopped_at - 1)
    return {"signal_to_checkpoint_s": round(complete - signalled, 3), "step_time_s": round(step_time, 4),
            "in_step_times": round((complete - signalled) / step_time, 2), "stopped_at_step": stopped_at}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=16)
    parser.add_argument("--results", default=str(REPO / "outputs" / "bench" / "bench.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stop-bench-") as tmp:
        root = Path(tmp)
        model, data = write_inputs(root)
        runs = [one_stop(root, model, data, args.grad_accum) for _ in range(args.runs)]
    for run in runs:
        print(f"  stopped after step {run['stopped_at_step']}: checkpoint complete {run['signal_to_checkpoint_s']} s "
              f"after SIGTERM, {run['in_step_times']} step times of {run['step_time_s']} s")
    seconds = [r["signal_to_checkpoint_s"] for r in runs]
    summary = {"runs": runs, "signal_to_checkpoint_s": {"min": min(seconds), "median": statistics.median(seconds),
                                                        "max": max(seconds)},
               "grad_accum": args.grad_accum, "signal_after_first_step_s": SIGNAL_AFTER_S}
    print(json.dumps(summary["signal_to_checkpoint_s"]))
    update_results(Path(args.results), "stop_latency", summary)


if __name__ == "__main__":
    main()
