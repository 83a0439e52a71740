"""Adapters merged into the base and written as a plain Hugging Face model directory: what
`python -m finetuning_pipeline.export` writes, and preflight's rehearsal checks loads."""

from __future__ import annotations

from pathlib import Path

import torch

from finetuning_pipeline.model.lineage import lineage_with, write_lineage
from finetuning_pipeline.model.loading import DTYPES as MODEL_DTYPES
from finetuning_pipeline.model.loading import load_model, stored_dtype
from finetuning_pipeline.model.new_tokens import serving_tokenizer
from utils.output_guard import claim_output, mark_written_by, staged_directory
from utils.tokenizer_loading import load_tokenizer

DTYPES = {"auto": None, **MODEL_DTYPES}
COMMAND = "finetuning_pipeline.export"


def export_merged(base: str, adapters: list[str], out: str, dtype: str = "auto", tokenizer: str | None = None,
                  force: bool = False, warn=None) -> Path:
    """Merge `adapters` (in order) into `base` and save to `out`; returns `out`. An existing
    `out` is replaced only with force, and only when an earlier export wrote it; `out` may not
    overlap the base, an adapter or the tokenizer. warn: where notes go (default: stderr)."""
    out_path = Path(out)
    inputs = {"--base": base, "--tokenizer": tokenizer, **{f"--adapter {a}": a for a in adapters}}
    claim_output(out_path, force=force, command=COMMAND, inputs=inputs)
    loaded_tokenizer = load_tokenizer(*serving_tokenizer(base, adapters, tokenizer))  # (new tokens: an adapter's)
    # Read before loading: transformers' config then holds the dtype it was loaded in, not stored in.
    base_dtype = stored_dtype(base) or torch.float32
    # Merge in at least fp32 (each W0 + s B A is rounded once, into the output dtype, at save time).
    model, _ = load_model(base, adapters, torch.promote_types(base_dtype, torch.float32), warn=warn)
    model.config.use_cache = True  # the exported model is for inference
    model.to(DTYPES[dtype] or base_dtype)
    with staged_directory(out_path) as staging:
        model.save_pretrained(staging)
        loaded_tokenizer.save_pretrained(staging)
        # What it is made of: an adapter trained on it (or on the base with the same adapters
        # beneath) is applied on it without a word, any other is checked (lineage.py).
        write_lineage(staging, lineage_with(base, adapters))
        mark_written_by(staging, COMMAND)
    return out_path
