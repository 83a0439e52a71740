"""`make bench-gguf-export`: the host memory and time of `export --format gguf`, against the model's size.

    python -m benchmarks.gguf_export_bench [--outtypes f16,q8_0]

The Mistral of 675M parameters that `make bench-quantized-load` reads (hidden 2048, 12 layers,
vocabulary 32,000), written in bf16 (1.35 GB of files) with the demo's tokenizer, and a rank-16
adapter on its 7 default targets. Each export runs in a fresh process that samples its memory
(benchmarks/host_memory.py): the merged model as GGUF in each outtype, the adapter alone as a
LoRA GGUF, and, for scale, the merged Hugging Face export (which loads the model in fp32). The
streamed export should hold one tensor at a time beside the mapped files: an anonymous peak far
below the model's size. Results: the "gguf_export" section of outputs/bench/bench.json.
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
from benchmarks.quantized_load_bench import write_model
from benchmarks.results import update_results

RANK = 16


def write_inputs(root: Path) -> tuple[Path, Path]:
    """The bf16 base with the demo's tokenizer, and a random adapter of RANK for it."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetuning_pipeline.demo.tiny_model import build_tokenizer, train_sentencepiece
    from lora_logic.adapter_io import write_adapter
    from lora_logic.config import LoraConfig

    base = write_model(root / "base", "bfloat16")
    build_tokenizer(train_sentencepiece()).save_pretrained(base)
    config = LoraConfig(r=RANK, alpha=2 * RANK)
    generator = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, device_map="meta")
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in config.target_modules:
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, module.in_features, generator=generator) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(module.out_features, RANK, generator=generator) * 0.01
    return base, write_adapter(root / "adapter", tensors, config, str(base))


def measure(base: Path, adapter: Path, out: Path, what: str) -> dict:
    """One export, as `what` says, sampling memory meanwhile."""
    from finetuning_pipeline.exporters.gguf_export import export_gguf
    from finetuning_pipeline.exporters.merged import export_merged

    with peak_growth() as peaks:
        start = time.perf_counter()
        if what == "hf_merged":
            export_merged(str(base), [str(adapter)], str(out), "bfloat16")
        elif what == "gguf_adapter":
            export_gguf(str(base), [str(adapter)], str(out), "f16", adapter_only=True, warn=lambda _: None)
        else:
            export_gguf(str(base), [str(adapter)], str(out), what.removeprefix("gguf_"), warn=lambda _: None)
        seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in out.rglob("*")) if out.is_dir() else out.stat().st_size
    return {**peaks, "output_mib": round(size / 2**20), "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outtypes", default="f16,q8_0")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/bench.json"))
    parser.add_argument("--measure", nargs=4, metavar=("BASE", "ADAPTER", "OUT", "WHAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        base, adapter, out, what = args.measure
        print(json.dumps(measure(Path(base), Path(adapter), Path(out), what)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        base, adapter = write_inputs(Path(tmp))
        files_mib = round(sum(p.stat().st_size for p in base.glob("*.safetensors")) / 2**20)
        print(f"base: {files_mib} MiB of bf16 safetensors files; adapter: rank {RANK} on 7 targets", flush=True)
        cases = [f"gguf_{outtype}" for outtype in args.outtypes.split(",")] + ["gguf_adapter", "hf_merged"]
        for what in cases:
            out = Path(tmp) / (what if what == "hf_merged" else f"{what}.gguf")
            proc = subprocess.run([sys.executable, "-m", "benchmarks.gguf_export_bench", "--measure", str(base),
                                   str(adapter), str(out), what], capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
            figures = json.loads(proc.stdout.strip().splitlines()[-1])
            results[what] = figures
            print(f"{what:13s}: anonymous peak {figures['anonymous_peak_mib']:5d} MiB, RSS peak "
                  f"{figures['rss_peak_mib']:5d} MiB, output {figures['output_mib']:5d} MiB, {figures['seconds']} s",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    update_results(args.out, "gguf_export", {"base_files_mib": files_mib, "rank": RANK, "results": results})


if __name__ == "__main__":
    main()
