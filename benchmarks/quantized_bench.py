"""`make bench-quantized`: a LoRA step on a quantized base (model.quantize) against the same step
on the bf16 base, on XLA:CPU.

    python -m benchmarks.quantized_bench [--steps 12] [--formats none,q8_0,q4_0,nf4]

train_bench's "large" shape (8 layers, hidden 512, MLP 1536, micro-batch 8 x seq_len 512), LoRA
r 16 on all 7 targets, bf16 base, the real command (`finetuning_pipeline/main.py`) in a fresh
process per format. For each: the steady step time (the trainer's own figure, compiles excluded)
and the bytes the decoder's Linears hold on the device (summary.json's quantized_base; for none,
their bf16 size). On XLA:CPU the step time is only indicative: a TPU's matmul units and its
memory bandwidth, which quantization is for, are not a CPU's. Results: the "quantized_base"
section of outputs/bench/bench.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from benchmarks.results import update_results
from benchmarks.train_bench import ALPHA, LR, RANK, SHAPES, TARGETS, build_model, prepare_data

SHAPE = SHAPES["large"]


def run(root: Path, fmt: str, model_dir: Path, data: Path, steps: int) -> dict:
    config = {
        "output_dir": str(root / fmt),
        "model": {"path": str(model_dir), "dtype": "bfloat16", "quantize": fmt},
        "lora": {"r": RANK, "alpha": ALPHA, "target_modules": TARGETS},
        "train": {"max_steps": steps, "micro_batch": SHAPE["micro_batch"], "grad_accum": 1, "lr": LR,
                  "warmup_steps": 2, "warmup_compiles_steps": 3},
        "eval": {"max_batches": 1},
        "checkpoint": {"every": 0, "keep": 1},
        "logging": {"every": steps, "progress_bar": False, "tensorboard": False},
        "phase1": {"data": str(data)},
    }
    path = root / f"{fmt}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "finetuning_pipeline/main.py", "--config", str(path), "--phase", "1"],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"model.quantize={fmt} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((root / fmt / "phase1" / "summary.json").read_text())


def linear_bf16_bytes(model_dir: Path) -> int:
    from transformers import AutoConfig

    from finetuning_pipeline.planning.tpu_plan import ModelShape

    shape = ModelShape.from_config(AutoConfig.from_pretrained(model_dir))
    return 2 * shape.layers * shape.layer_linear_params


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--formats", default="none,q8_0,q4_0,nf4")
    parser.add_argument("--out", default="outputs/bench/bench.json")
    args = parser.parse_args(argv)
    results = {"config": {**SHAPE, "rank": RANK, "targets": TARGETS, "dtype": "bfloat16", "steps": args.steps}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = build_model(SHAPE, root)
        data = prepare_data(model_dir, SHAPE["seq_len"], root / "data")
        bf16_bytes = linear_bf16_bytes(model_dir)
        for fmt in args.formats.split(","):
            summary = run(root, fmt, model_dir, data, args.steps)
            stored = summary["quantized_base"]["weight_bytes"] if summary["quantized_base"] else bf16_bytes
            results[fmt] = {"step_time_s": summary["step_time_s"], "compile_seconds": summary["compile_seconds"],
                            "decoder_linear_bytes": stored, "bytes_vs_bf16": round(stored / bf16_bytes, 3)}
    base = results.get("none", {}).get("step_time_s")
    for fmt in args.formats.split(","):
        r = results[fmt]
        if base:
            r["step_vs_bf16"] = round(r["step_time_s"] / base, 3)
        print(f"model.quantize={fmt:5}  step {r['step_time_s']:.4f} s"
              + (f" ({r['step_vs_bf16']:.2f}x bf16)" if base else "")
              + f"  decoder Linears {r['decoder_linear_bytes'] / 2**20:.1f} MiB ({r['bytes_vs_bf16']:.3f}x bf16)"
              + f"  compile {r['compile_seconds']:.1f} s")
    update_results(Path(args.out), "quantized_base", results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
