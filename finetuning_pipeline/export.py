"""Merge adapters into the base and write a plain Hugging Face model directory.

    python -m finetuning_pipeline.export --base BASE_DIR --adapter outputs/run/phase2/adapter --out MERGED_DIR

With phase2.init=merge, phase 2's adapter sits on top of phase 1's: pass both, in order
(`--adapter .../phase1/adapter --adapter .../phase2/adapter`). The output (safetensors,
config, generation config, tokenizer) loads with `AutoModelForCausalLM.from_pretrained` and
needs neither this project nor PEFT. It appears only when complete (written next to --out,
then renamed). --out may not be or hold an input, and an existing --out is replaced only with
--force and only when an earlier export wrote it (utils/output_guard.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from finetuning_pipeline.errors import run_command
from finetuning_pipeline.model_loading import DTYPES as MODEL_DTYPES
from finetuning_pipeline.model_loading import load_model
from utils.output_guard import claim_output, mark_written_by, staged_directory
from utils.hub_models import resolve_model
from utils.tokenizer_loading import load_tokenizer

DTYPES = {"auto": None, **MODEL_DTYPES}
COMMAND = "finetuning_pipeline.export"


def export_merged(base: str, adapters: list[str], out: str, dtype: str = "auto", tokenizer: str | None = None,
                  force: bool = False) -> Path:
    """Merge `adapters` (in order) into `base` and save to `out`; returns `out`. An existing
    `out` is replaced only with force, and only when an earlier export wrote it; `out` may not
    overlap the base, an adapter or the tokenizer."""
    out_path = Path(out)
    inputs = {"--base": base, "--tokenizer": tokenizer, **{f"--adapter {a}": a for a in adapters}}
    claim_output(out_path, force=force, command=COMMAND, inputs=inputs)
    loaded_tokenizer = load_tokenizer(tokenizer or base, "--tokenizer" if tokenizer else "--base")
    # Merge in fp32 (each W0 + s B A is rounded once, into the output dtype, at save time).
    model, _ = load_model(base, adapters, torch.float32)
    model.config.use_cache = True  # the exported model is for inference
    saved_dtype = DTYPES[dtype] or getattr(model.config, "dtype", None) or torch.float32
    if isinstance(saved_dtype, str):
        saved_dtype = getattr(torch, saved_dtype)
    model.to(saved_dtype)
    with staged_directory(out_path) as staging:
        model.save_pretrained(staging)
        loaded_tokenizer.save_pretrained(staging)
        mark_written_by(staging, COMMAND)
    return out_path


def main(argv: list[str] | None = None) -> int:
    return run_command(export_command, argv)


def export_command(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the base: a Hugging Face model directory or a Hub id")
    parser.add_argument("--adapter", action="append", required=True, help="adapter directory (repeat to stack, in order)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="saved dtype (default: the base's)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: --base)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out that an earlier export wrote")
    args = parser.parse_args(argv)
    base = resolve_model(args.base).local_dir  # a Hub id: from the Hugging Face cache (downloaded if online)
    out = export_merged(base, args.adapter, args.out, args.dtype, args.tokenizer, args.force)
    print(f"wrote merged model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
