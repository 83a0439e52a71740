"""`make bench-lora-cost`: where a LoRA step's time and compile go beyond the frozen model's.

    python -m benchmarks.lora_cost_bench [--repeats 12] [--shape large]

Three measurements on XLA:CPU, fp32, at `make bench-train`'s large shape (4096 tokens a
micro-batch, hidden 512, k/v 256, LoRA r 16):
  products   each of the six products a LoRA layer adds (forward: x A^T, h B^T; backward:
             dh = dy B, dB = dy^T h, dA = dh^T x, dx += dh A), each its own graph, against the
             base's own x W^T: the time of the LoRA's arithmetic, product by product; and dB
             in the form the LoRA layer keeps, (h^T dy)^T behind a barrier; and for scale, one
             fused pass that reads x, and one that reads and writes it;
  attention  one attention input's q, k and v, forward and backward: frozen, with three LoRAs
             each reading the input, and with their A products shared (lora_logic/layer.py);
  kernels    the kernels XLA:CPU compiles for the trainer's captured step on a bench shape,
             counted by kind from XLA's own dump (`--xla_dump_to`): what its compile time is
             made of (each distinct kernel is an LLVM module compiled on its own).
Times are medians over `--repeats` runs, the variants interleaved; each graph is compiled
before it is timed. Results: the `lora_cost` section of outputs/bench/bench.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results import update_results

TOKENS, HIDDEN, KV, RANK = 4096, 512, 256, 16


def timed(variants: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds of each variant (a function returning the tensors to compute), interleaved."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    times = {name: [] for name in variants}
    for repeat in range(repeats + 2):  # the first two compile
        for name, run in variants.items():
            xm.wait_device_ops()
            began = time.perf_counter()
            kept = run()  # (alive across the sync: what nothing holds is not computed)
            torch_xla.sync()
            xm.wait_device_ops()
            del kept
            if repeat >= 2:
                times[name].append(time.perf_counter() - began)
    return {name: round(1000 * statistics.median(values), 2) for name, values in times.items()}


def products(repeats: int) -> dict[str, float]:
    import torch

    from finetuning_pipeline.runtime.xla.device import init_xla_device
    from utils.device_ops import barrier_copies

    device = init_xla_device()
    x, dy = torch.randn(TOKENS, HIDDEN).to(device), torch.randn(TOKENS, HIDDEN).to(device)
    w = torch.randn(HIDDEN, HIDDEN).to(device)
    a, b = torch.randn(RANK, HIDDEN).to(device), torch.randn(HIDDEN, RANK).to(device)
    h, dh = torch.randn(TOKENS, RANK).to(device), torch.randn(TOKENS, RANK).to(device)
    return timed({
        "base x W^T": lambda: x @ w.t(),
        "forward x A^T": lambda: x @ a.t(),
        "forward h B^T": lambda: h @ b.t(),
        "backward dh = dy B": lambda: dy @ b,
        "backward dB = dy^T h": lambda: dy.t() @ h,  # the form XLA folds autograd's h^T dy, transposed, into
        "backward dB = (h^T dy)^T, kept": lambda: barrier_copies(h.t() @ dy)[0].t(),  # lora_logic/layer.py's
        "backward dA = dh^T x": lambda: dh.t() @ x,
        "backward dx += dh A": lambda: x + dh @ a,
        # What memory allows: one pass over an activation, as a fused kernel reads and writes it.
        "reference: x summed by rows": lambda: x.sum(1),
        "reference: x * 2": lambda: x * 2,
    }, repeats)


def attention(repeats: int) -> dict[str, float]:
    import torch
    from torch import nn

    from finetuning_pipeline.runtime.xla.device import init_xla_device
    from lora_logic.config import LoraConfig
    from lora_logic.layer import LoRALinear, share_input

    device = init_xla_device()
    torch.manual_seed(0)
    x0 = torch.randn(TOKENS, HIDDEN).to(device)
    layers = {}
    for variant in ("frozen", "three LoRAs", "shared A product"):
        bases = [nn.Linear(HIDDEN, out, bias=False) for out in (HIDDEN, KV, KV)]
        if variant == "frozen":
            layers[variant] = [base.requires_grad_(False).to(device) for base in bases]
            continue
        wrapped = [LoRALinear(base) for base in bases]
        for layer in wrapped:
            layer.add_adapter("default", LoraConfig(r=RANK, alpha=2 * RANK))
        if variant == "shared A product":
            share_input(wrapped)
        layers[variant] = [layer.to(device) for layer in wrapped]
    weights = [torch.randn(out).to(device) for out in (HIDDEN, KV, KV)]

    def step(variant: str):
        def run():
            x = x0.clone().requires_grad_(True)
            sum((layer(x) * weight).sum() for layer, weight in zip(layers[variant], weights)).backward()
            for layer in layers[variant]:
                for p in layer.parameters():
                    p.grad = None
            return x.grad
        return run

    return timed({variant: step(variant) for variant in layers}, repeats)


def kernels(shape: str) -> dict:
    """The kernels of the captured step's compiled graph, by kind (XLA's dump names each)."""
    with tempfile.TemporaryDirectory() as dump:
        env = {**os.environ, "PJRT_DEVICE": "CPU", "XLA_FLAGS": f"--xla_dump_to={dump}"}
        proc = subprocess.run([sys.executable, "-m", "benchmarks.host_bench", "--measure", "0", "1",
                               "trainer_default", "2", shape], capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"the step on the {shape} shape failed:\n{proc.stderr[-3000:]}")
        names = [p.name for p in Path(dump).glob("*_kernel_module.ir-with-opt.ll")]
    # module_0003.SyncTensorsGraph.10394.gather_bitcast_fusion.103.clone_kernel_module... -> gather_bitcast_fusion
    kinds = collections.Counter(re.sub(r"\.\d+|\.clone", "", n.split(".", 3)[3].split("_kernel_module")[0])
                                for n in names)
    return {"compile_s": json.loads(proc.stdout.strip().splitlines()[-1])["compile_s"], "kernels": len(names),
            "by_kind": dict(kinds.most_common())}


def in_subprocess(kind: str, *args) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lora_cost_bench", "--measure", kind, *map(str, args)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


MEASURES = {"products": products, "attention": attention}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--shape", default="large", help="make bench-train's shape whose step's kernels are counted")
    parser.add_argument("--out", default="outputs/bench/bench.json")
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:  # a child process: one measurement, printed as JSON
        kind, repeats = args.measure
        print(json.dumps(MEASURES[kind](int(repeats))))
        return
    section = {"tokens": TOKENS, "hidden": HIDDEN, "rank": RANK, "ms": {}}
    for kind in MEASURES:
        section["ms"][kind] = figures = in_subprocess(kind, args.repeats)
        for name, ms in figures.items():
            print(f"{kind:9} {name:24} {ms:8.2f} ms", flush=True)
    section["kernels"] = census = kernels(args.shape)
    top = ", ".join(f"{kind} {count}" for kind, count in list(census["by_kind"].items())[:8])
    print(f"the {args.shape} shape's step: {census['kernels']} kernels, compiled in {census['compile_s']} s; {top}")
    update_results(Path(args.out), "lora_cost", section)
    print(f"wrote the lora_cost section of {args.out}")


if __name__ == "__main__":
    main()
