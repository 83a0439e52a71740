"""Merge adapters into the base and write a plain Hugging Face model directory, or combine
several adapters into one.

    python -m finetuning_pipeline.export --base BASE_DIR --adapter outputs/run/phase2/adapter --out MERGED_DIR
    python -m finetuning_pipeline.export --base BASE --adapter A1 --adapter A2 --weights 0.7,0.3 \
        --combine linear|cat|svd|ties|dare_linear|dare_ties [--density 0.5] [--adapter-only] --out DIR
    python -m finetuning_pipeline.export --format gguf --outtype q8_0 --base BASE [--adapter A ...] \
        [--adapter-only] --out model.gguf

A phase whose init merged earlier adapters sits on top of them: its summary.json lists them
(`merged_adapters`); pass those, then its own, in order (phase2.init=merge: `--adapter
.../phase1/adapter --adapter .../phase2/adapter`). The output (safetensors,
config, generation config, tokenizer) loads with `AutoModelForCausalLM.from_pretrained` and
needs neither this project nor PEFT.

--combine combines adapters of one base, trained apart, into one, as PEFT's
`add_weighted_adapter` does (lora_logic/combine.py says how each method weighs them): merged
into the base, or written as one PEFT adapter with --adapter-only. --weights defaults to 1 for
each adapter; ties and the DARE methods need --density; DARE's random drop is drawn from --seed.

--format gguf writes one GGUF file for llama.cpp, Ollama and LM Studio instead
(exporters/gguf_export.py): the base with the adapters merged (stacked, in order, or combined),
the base alone with no --adapter, or with --adapter-only the adapters as a LoRA GGUF that
llama.cpp applies to the base's GGUF at load (`llama-cli -m base.gguf --lora adapter.gguf`), so
one base file serves many adapters. --outtype: f32, f16 (default), bf16, q8_0 or q4_0 for a model;
f32, f16 or bf16 for an adapter. K-quants (Q4_K_M, ...) are llama.cpp's own: write f16, then
`llama-quantize model-f16.gguf model-Q4_K_M.gguf Q4_K_M` (llama.cpp's tools, built apart).

The output appears only when complete (written next to --out, then renamed). --out may not be
or hold an input, and an existing --out is replaced only with --force and only when an earlier
export wrote it (utils/output_guard.py).
"""

from __future__ import annotations

import argparse
import sys

from finetuning_pipeline.errors import run_command
from finetuning_pipeline.exporters.combined import export_combined
from finetuning_pipeline.exporters.gguf_export import export_gguf
from finetuning_pipeline.exporters.gguf_tensors import OUTTYPES
from finetuning_pipeline.exporters.merged import DTYPES, export_merged
from finetuning_pipeline.runtime.xla.device import on_the_host_only
from lora_logic.combine import COMBINE_METHODS
from utils.hub_models import resolve_model


def main(argv: list[str] | None = None) -> int:
    return run_command(export_command, argv)


def export_command(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="tpu-lora export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the base: a Hugging Face model directory or a Hub id")
    parser.add_argument(
        "--adapter", action="append", default=[],
        help="adapter directory (repeat to stack, in order); --format gguf without one writes the base alone"
    )
    parser.add_argument("--out", required=True, help="output directory (a .gguf file with --format gguf)")
    parser.add_argument("--format", choices=("hf", "gguf"), default="hf",
                        help="hf: a Hugging Face model directory (default); gguf: one GGUF file for llama.cpp")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                        help="--format hf: saved dtype (default: the base's)")
    parser.add_argument("--outtype", metavar="{" + ",".join(OUTTYPES) + "}",
                        help="--format gguf: the weights' type (default f16; q8_0 and q4_0 are ggml's block "
                             "formats; for K-quants run llama.cpp's llama-quantize on an f16 export)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: --base)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out that an earlier export wrote")
    parser.add_argument("--combine", choices=COMBINE_METHODS,
                        help="combine the adapters into one, as PEFT's add_weighted_adapter (instead of stacking them)")
    parser.add_argument("--weights", type=weight_list, help="one weight per --adapter, e.g. 0.7,0.3 (default: 1 each)")
    parser.add_argument("--density", type=float, help="ties, dare_linear, dare_ties: the fraction of each matrix kept")
    parser.add_argument("--svd-rank", type=int, help="svd: the combined adapter's rank (default: the largest)")
    parser.add_argument("--seed", type=int, default=0, help="dare_linear, dare_ties: the seed of the random drop")
    parser.add_argument("--adapter-only", action="store_true",
                        help="write the adapters, not a merged model: with --combine the combined adapter (PEFT's "
                             "layout, or GGUF's with --format gguf); with --format gguf a LoRA GGUF")
    args = parser.parse_args(argv)
    on_the_host_only()
    gguf = args.format == "gguf"
    if not args.combine:
        given = [flag for flag, value in (("--weights", args.weights), ("--density", args.density),
                                          ("--svd-rank", args.svd_rank),
                                          ("--adapter-only", args.adapter_only and not gguf))
                 if value]
        if given:
            parser.error(f"{', '.join(given)} go with --combine (without it the adapters are stacked, in order)")
    if not args.adapter and not gguf:
        parser.error("--adapter is required (--format gguf without one writes the base alone)")
    if args.outtype and not gguf:
        parser.error("--outtype goes with --format gguf (--dtype sets a Hugging Face export's dtype)")
    if gguf and args.dtype != "auto":
        parser.error("--dtype goes with --format hf (--outtype sets a GGUF's type)")
    if args.combine and not args.adapter:
        parser.error("--combine needs the adapters to combine (--adapter, repeated)")
    base = resolve_model(args.base).local_dir  # a Hub id: from the Hugging Face cache (downloaded if online)
    gguf_options = {"outtype": args.outtype or "f16"} if gguf else None
    if args.combine:
        weights = args.weights or [1.0] * len(args.adapter)
        out = export_combined(base, args.adapter, args.out, weights=weights, method=args.combine, density=args.density,
                              svd_rank=args.svd_rank, seed=args.seed, adapter_only=args.adapter_only,
                              dtype=args.dtype, tokenizer=args.tokenizer, force=args.force, gguf=gguf_options)
        what = "combined adapter" if args.adapter_only else "merged model (adapters combined)"
    elif gguf:
        out = export_gguf(base, args.adapter, args.out, gguf_options["outtype"], args.tokenizer, args.force,
                          adapter_only=args.adapter_only)
        what = "LoRA adapter" if args.adapter_only else "merged model" if args.adapter else "base model"
    else:
        out = export_merged(base, args.adapter, args.out, args.dtype, args.tokenizer, args.force)
        what = "merged model"
    if gguf:
        what += f" as GGUF ({gguf_options['outtype']})"
    print(f"wrote {what} to {out}")
    return 0


def weight_list(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, e.g. 0.7,0.3; got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
