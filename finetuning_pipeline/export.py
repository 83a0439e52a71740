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

from finetuning_pipeline.errors import run_command
from finetuning_pipeline.model.merged_export import DTYPES, export_merged
from utils.hub_models import resolve_model


def main(argv: list[str] | None = None) -> int:
    return run_command(export_command, argv)


def export_command(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the base: a Hugging Face model directory or a Hub id")
    parser.add_argument(
        "--adapter", action="append", required=True, help="adapter directory (repeat to stack, in order)"
    )
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
