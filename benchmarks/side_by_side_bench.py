"""`make bench-side-by-side`: K adapters trained side by side in one run against the same K
adapters trained one after another, on XLA:CPU.

    python -m benchmarks.side_by_side_bench [--adapters 4] [--steps 20]

The base is train_bench's "large" shape (8 layers, hidden 512, about 30M parameters, fp32),
each adapter LoRA r 16 on all 7 targets with a small batch of its own (micro-batch 1 x
seq_len 64, no accumulation), so that a step of one adapter alone does little work for every
read of the base's weights: the case side by side is for (several small tasks on one base).
Each run is the real command, `finetuning_pipeline/main.py`, in a fresh process, timed from
start to exit: model load, compile, the steps, evaluation and the adapter written. Side by
side: one run of K adapters (`phase1.adapters`); one after another: K runs of one adapter
each, their wall times added. Both sides train the same adapters on the same data for the
same steps. Results: the "side_by_side" section of outputs/bench/bench.json and a line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.results import update_results
from benchmarks.train_bench import ALPHA, LR, RANK, SHAPES, TARGETS, build_model, prepare_data

SEQ_LEN, MICRO_BATCH = 64, 1


def run_config(root: Path, name: str, model_dir: Path, data: Path, steps: int, adapters: list[str] | None) -> Path:
    phase1 = ({"adapters": {a: {"data": str(data)} for a in adapters}} if adapters else {"data": str(data)})
    config = {
        "output_dir": str(root / name),
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"r": RANK, "alpha": ALPHA, "target_modules": TARGETS},
        "train": {"max_steps": steps, "micro_batch": MICRO_BATCH, "grad_accum": 1, "lr": LR, "warmup_steps": 2},
        "eval": {"max_batches": 1},
        "checkpoint": {"every": 0, "keep": 1},
        "logging": {"every": steps, "progress_bar": False, "tensorboard": False},
        "phase1": phase1,
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def timed_run(config: Path) -> tuple[float, dict]:
    """Wall seconds of the whole command in a fresh process, and its phase-1 summary."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "finetuning_pipeline/main.py", "--config", str(config), "--phase", "1"],
                          capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{config} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    output_dir = Path(yaml.safe_load(config.read_text())["output_dir"])
    return wall, json.loads((output_dir / "phase1" / "summary.json").read_text())


def bench(adapters: int, steps: int, root: Path) -> dict:
    model_dir = build_model(SHAPES["large"], root)
    data = prepare_data(model_dir, SEQ_LEN, root / "data")
    names = [f"task{k}" for k in range(adapters)]
    together_s, together = timed_run(run_config(root, "side_by_side", model_dir, data, steps, names))
    alone = [timed_run(run_config(root, name, model_dir, data, steps, None)) for name in names]
    alone_s = sum(wall for wall, _ in alone)
    return {
        "config": {"model": SHAPES["large"]["model"], "adapters": adapters, "steps": steps, "rank": RANK,
                   "targets": TARGETS, "micro_batch_per_adapter": MICRO_BATCH, "seq_len": SEQ_LEN, "dtype": "float32"},
        "side_by_side_wall_s": round(together_s, 1),
        "one_after_another_wall_s": round(alone_s, 1),
        "each_alone_wall_s": [round(wall, 1) for wall, _ in alone],
        "wall_ratio": round(alone_s / together_s, 2),
        "side_by_side_step_s": together["step_time_s"],
        "one_after_another_step_s": round(sum(s["step_time_s"] for _, s in alone), 4),
        "step_ratio": round(sum(s["step_time_s"] for _, s in alone) / together["step_time_s"], 2),
        "side_by_side_compile_s": together["compile_seconds"],
        "one_after_another_compile_s": round(sum(s["compile_seconds"] for _, s in alone), 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="outputs/bench/bench.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = bench(args.adapters, args.steps, Path(tmp))
    update_results(Path(args.out), "side_by_side", result)
    print(f"{args.adapters} adapters x {args.steps} steps: side by side {result['side_by_side_wall_s']} s, one after "
          f"another {result['one_after_another_wall_s']} s (x{result['wall_ratio']} wall, load and compile included; "
          f"x{result['step_ratio']} per step); wrote {args.out}")


if __name__ == "__main__":
    main()
