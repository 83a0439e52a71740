"""`make bench-quantized-load`: the host memory of loading a base with `model.quantize`.

    python -m benchmarks.quantized_load_bench [--formats q8_0,q4_0]

A Mistral of 675M parameters (hidden 2048, MLP 5632, 12 layers, vocabulary 32,000), written once
in fp16 (as Llama 2 ships) and once in bf16, is loaded for a bf16 run, each load in a fresh
process that samples its own memory every 5 ms (/proc/self/status):
  read_then_quantize  the whole model read in bf16, then its decoder Linears quantized (what a
                      run that first merges an earlier phase's adapter does)
  quantize_as_read    `load_base(..., quantize=Q)`, what a run without merges does: fp16 files
                      are read as stored and each Linear is quantized from them
  none                `load_base` in bf16, unquantized, for scale
The figures: the peak of anonymous memory (what the host must really have: it cannot be
reclaimed), the peak resident set (anonymous plus the files' pages read, which the kernel drops
when memory runs short), both as the process's growth over its memory before the load, and the
bytes the quantized model holds. Results: the "quantized_load" section of outputs/bench/bench.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.host_memory import peak_growth
from benchmarks.results import update_results

SHAPE = dict(vocab_size=32_000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)


def write_model(path: Path, dtype_name: str) -> Path:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        MistralForCausalLM(MistralConfig(**SHAPE)).to(getattr(torch, dtype_name)).save_pretrained(path)
    return path


def measure(model_dir: Path, how: str, fmt: str) -> dict:
    """Load the model as `how` says, sampling memory meanwhile; the peaks over the memory before."""
    import torch

    from finetuning_pipeline.model.loading import load_base
    from finetuning_pipeline.model.quantized_base import decoder_weight_bytes, quantize_base

    with peak_growth() as peaks:
        start = time.perf_counter()
        if how == "read_then_quantize":
            model = load_base(model_dir, torch.bfloat16)
            quantize_base(model, fmt)
        else:
            model = load_base(model_dir, torch.bfloat16, quantize=fmt if how == "quantize_as_read" else "none")
        seconds = time.perf_counter() - start
    return {**peaks,
            "decoder_linears_mib": round(decoder_weight_bytes(model) / 2**20),
            "model_mib": round(sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20),
            "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="q8_0,q4_0")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/bench.json"))
    parser.add_argument("--measure", nargs=3, metavar=("MODEL_DIR", "HOW", "FORMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure[0]), args.measure[1], args.measure[2])))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stored in ("float16", "bfloat16"):
            model_dir = write_model(Path(tmp) / stored, stored)
            cases = [("none", "none")] + [(how, fmt) for fmt in args.formats.split(",")
                                          for how in ("read_then_quantize", "quantize_as_read")]
            for how, fmt in cases:
                proc = subprocess.run([sys.executable, "-m", "benchmarks.quantized_load_bench", "--measure",
                                       str(model_dir), how, fmt], capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    raise SystemExit(f"{stored} {how} {fmt} failed:\n{proc.stderr[-3000:]}")
                figures = json.loads(proc.stdout.strip().splitlines()[-1])
                results[f"{stored}_files/{how}/{fmt}"] = figures
                print(f"{stored} files, {how:18s} {fmt:5s}: anonymous peak {figures['anonymous_peak_mib']:6d} MiB, "
                      f"RSS peak {figures['rss_peak_mib']:6d} MiB, model {figures['model_mib']:6d} MiB "
                      f"(decoder Linears {figures['decoder_linears_mib']}), {figures['seconds']} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    update_results(args.out, "quantized_load", {"shape": SHAPE, "run_dtype": "bfloat16", "results": results})


if __name__ == "__main__":
    main()
