"""`make bench-host`: the host's time per training step and the compile time, by depth and
gradient accumulation, for the trainer's default step (captured, the decoder layers scanned:
train.capture_step, train.scan_layers), the captured step over the layer loop, and the step
traced every time (the trainer before both).

    python -m benchmarks.host_bench [--layers 32] [--grad-accum 1,8] [--steps 10]
        [--modes scanned,layer_loop,traced_every_step]

Model: Mistral architecture 64 wide (hidden 64, 4 query heads and 2 KV heads of 16, MLP 128,
vocabulary 1024), LoRA r 16 on all 7 targets, AdamW, fp32, one micro-batch of 1 x 64 tokens per
accumulation step: so small that the device's share is negligible and the figures are the
trainer's own host work, which is what holds a TPU back (a TPU runs a small model's step in
milliseconds; tracing costs the same host time whatever the width).

host_ms_per_step: the device is idle before each step (`xm.wait_device_ops`), then the clock
runs over the trainer's `Stepper` call and the step boundary (`torch_xla.sync`): Python,
tracing or binding, graph hashing and launch. The median of the steps after warm-up.
compile_s: torch_xla's CompileTime metric over the run (every graph the steps compiled).
Each measurement runs in a fresh process. Results: the `host` section of
outputs/bench/bench.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.results import update_results

MODEL = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128, "sliding_window": None}
SEQ_LEN, RANK, ALPHA = 64, 16, 32
WARMUP_STEPS = 2  # the first step traces (and captures) and compiles; the second replays once


# How the step is run: (train.capture_step, decoder layers scanned); the bench.json key.
MODES = {"scanned": (True, True), "layer_loop": (True, False), "traced_every_step": (False, False)}
# `make bench-train`'s shapes run the trainer's own step: captured, scanned where the trainer
# would scan (train.scan_layers unset: from 16 layers; both shapes are shallower).
TRAINER_DEFAULT = "trainer_default"


def measure(layers: int, grad_accum: int, mode: str, steps: int, shape: str = "") -> dict:
    """One configuration, in this process. shape: one of `make bench-train`'s shapes instead of
    the 64-wide model (its model, micro-batch and sequence length; `layers` is then its own)."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    from transformers import MistralConfig, MistralForCausalLM

    from finetuning_pipeline.distributed.parallel import Parallel
    from finetuning_pipeline.run_config import load_config
    from finetuning_pipeline.runtime.xla.counters import read_counters
    from finetuning_pipeline.runtime.xla.device import init_xla_device
    from finetuning_pipeline.runtime.xla.runtime import XlaRuntime
    from finetuning_pipeline.runtime.xla.scan_choice import scan_layers
    from finetuning_pipeline.train.adamw import MaskedAdamW
    from finetuning_pipeline.train.stepper import Stepper
    from lora_logic.adapters import lora_parameters
    from lora_logic.inject import inject_lora

    capture, scan = (True, None) if mode == TRAINER_DEFAULT else MODES[mode]
    model_config, seq_len, micro_batch = {"num_hidden_layers": layers, **MODEL}, SEQ_LEN, 1
    if shape:
        model_config, seq_len, micro_batch = bench_shape(shape)
    device = init_xla_device()
    config = load_config(
        None,
        [
            "model.path=unused",
            "model.dtype=float32",
            f"lora.r={RANK}",
            f"lora.alpha={ALPHA}",
            f"train.grad_accum={grad_accum}",
            f"train.micro_batch={micro_batch}",
            f"train.max_steps={steps + WARMUP_STEPS}",
            f"train.capture_step={str(capture).lower()}",
        ],
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**model_config))
    inject_lora(model, config.lora_config())
    scan_layers(
        model, scan, activation_checkpointing=False, spmd=False
    )  # as the trainer does: on the host, after injection
    model.to(device).train()
    optimizer = MaskedAdamW(lora_parameters(model), lr=1e-3)
    stepper = Stepper(
        model,
        optimizer,
        config.train,
        phase=1,
        lr=config.lr(1),
        max_steps=config.max_steps(1),
        activation_checkpointing=False,
        parallel=Parallel("dp"),
        device=device,
        start_step=0,
        packed=False,
        runtime=XlaRuntime(),
    )
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps + WARMUP_STEPS):
        step_batches = []
        for _ in range(grad_accum):
            ids = torch.randint(0, model_config["vocab_size"], (micro_batch, seq_len), generator=generator,
                                dtype=torch.int32)
            step_batches.append({"input_ids": ids.to(device), "labels": ids.to(device)})
        batches.append(step_batches)
    torch_xla.sync()
    xm.wait_device_ops()
    start = read_counters()
    times, warm = [], None
    for step, micro_batches in enumerate(batches):
        xm.wait_device_ops()  # the device idle: what follows is host work only
        began = time.perf_counter()
        stepper(step, micro_batches)
        torch_xla.sync()
        times.append(time.perf_counter() - began)
        if step == WARMUP_STEPS - 1:
            xm.wait_device_ops()
            warm = read_counters()
    xm.wait_device_ops()
    end = read_counters()
    # Each graph's own (the gradients' and the update's: step_capture.py), in the order compiled.
    compiled = end.compiles - start.compiles
    samples = met.metric_data("CompileTime")[2][-compiled:] if compiled else []
    return {
        "compile_s_per_graph": [round(value / 1e9, 2) for _, value in samples],
        "host_ms_per_step": round(1000 * statistics.median(times[WARMUP_STEPS:]), 2),
        "compile_s": round(end.compile_seconds - start.compile_seconds, 2),
        "graphs": end.compiles - start.compiles,
        "compiles_after_warmup": end.compiles - warm.compiles,
        "host_syncs_per_step": (end.host_syncs - warm.host_syncs) / steps,
    }


def bench_shape(name: str) -> tuple[dict, int, int]:
    """(model config, seq_len, micro_batch) of a `make bench-train` shape (benchmarks/train_bench.py)."""
    from benchmarks.train_bench import SHAPES
    from finetuning_pipeline.demo.tiny_model import TINY_DIMENSIONS, VOCAB_SIZE

    shape = SHAPES[name]
    dimensions = TINY_DIMENSIONS if shape["model"] == "tiny" else shape["model"]
    config = {**dimensions, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 1024, "sliding_window": None}
    return config, shape["seq_len"], shape["micro_batch"]


def in_subprocess(layers: int, grad_accum: int, mode: str, steps: int, shape: str = "") -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.host_bench", "--measure", str(layers), str(grad_accum),
                           mode, str(steps), *([shape] if shape else [])],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"host bench failed ({shape or layers} layers, grad_accum {grad_accum}, {mode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--grad-accum", default="1,8", help="comma-separated gradient accumulation steps ('' for none)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument("--out", default="outputs/bench/bench.json")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--bench-shapes", default="small,large",
                        help="also make bench-train's shapes (comma-separated; '' for none): the trainer's step, "
                             "grad_accum 1, for its compile time")
    parser.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:  # a child process: one measurement, printed as JSON
        layers, grad_accum, mode, steps, *shape = args.measure
        print(json.dumps(measure(int(layers), int(grad_accum), mode, int(steps), *shape)))
        return
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes: {sorted(set(modes) - set(MODES))} unknown; choose from {', '.join(MODES)}")
    section = {
        "layers": args.layers,
        "model": {**MODEL, "seq_len": SEQ_LEN, "micro_batch": 1, "lora_r": RANK, "lora_targets": 7, "dtype": "float32"},
        "grad_accum": {},
    }
    for accum in [int(v) for v in args.grad_accum.split(",") if v]:
        for mode in modes:
            # The default step's figures are the section's own; the others under their mode.
            where = (
                section["grad_accum"]
                if mode == "scanned"
                else section.setdefault(mode, {"grad_accum": {}})["grad_accum"]
            )
            where[str(accum)] = figures = in_subprocess(args.layers, accum, mode, args.steps)
            print(
                f"{args.layers} layers, grad_accum {accum:>2}, {mode:17}: "
                f"host {figures['host_ms_per_step']:8.1f} ms/step"
                f"  compile {figures['compile_s']:6.1f} s  graphs {figures['graphs']} "
                f"({figures['compiles_after_warmup']} after warm-up)  host syncs/step {figures['host_syncs_per_step']}",
                flush=True,
            )
    for shape in filter(None, args.bench_shapes.split(",")):
        figures = in_subprocess(0, 1, TRAINER_DEFAULT, args.steps, shape)
        section.setdefault("bench_shapes", {})[shape] = figures
        print(f"make bench-train's {shape} shape, the trainer's step: compile {figures['compile_s']:.2f} s (per graph "
              f"{figures['compile_s_per_graph']})  host {figures['host_ms_per_step']:.1f} ms/step", flush=True)
    update_results(Path(args.out), "host", section)
    print(f"wrote the host section of {args.out}")


if __name__ == "__main__":
    main()
