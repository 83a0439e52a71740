"""One way to load a model: a Hugging Face base, then adapters in order, merged or not.

Used by the trainer (phase 2 on top of phase 1), `evaluate`, `generate` and `export`, so they
cannot disagree about what "base + adapter" means. A missing or mismatched directory is a
`ModelLoadError` naming it (the commands print it and exit 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from finetuning_pipeline.errors import ModelLoadError
from finetuning_pipeline.model.lineage import check_stack, trained_quantized
from finetuning_pipeline.model.new_tokens import add_token_rows, token_rows_of
from finetuning_pipeline.model.quantized_base import (
    NONE,
    cast_as_loaded,
    quantization_problems,
    quantize_base,
    reading_dtype,
)
from lora_logic.adapter_io import load_adapters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora
from lora_logic.layer import LoRALinear
from lora_logic.merge import merge_and_unload
from lora_logic.quantize import FORMATS

# float64: the CPU's exactness proofs only (docs/development.md, "How the tests prove equality"); a TPU refuses it.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def stored_dtype(path: str | Path) -> torch.dtype | None:
    """The dtype the model in `path` says it is stored in (its config.json's "dtype", or
    "torch_dtype" in files written before transformers 5); None when it names none we know or the
    file is unreadable (load_base then names the problem)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return DTYPES.get(name) if isinstance(name, str) else None


def load_base(path: str | Path, dtype: torch.dtype = torch.float32, quantize: str = NONE):
    """The Hugging Face causal LM in `path`, in `dtype`, with the KV cache off (training and
    scoring never use it; under XLA transformers 5's cache code breaks with sliding windows).

    quantize: its decoder Linears stored in this format (quantized_base.py), quantized straight
    from the files where they hold another dtype than `dtype` (reading_dtype): the host then
    never holds the whole model in `dtype`."""
    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json here; expected a Hugging Face model directory")
    read_as = reading_dtype(path, dtype) if quantize != NONE else dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=read_as)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: cannot load the model ({err})") from None
    model.config.use_cache = False
    quantize_base(model, quantize, dtype)
    if read_as != dtype:
        cast_as_loaded(model, dtype)
    return model


def weightless_model(model_config):
    """The architecture of `model_config` on the meta device: shapes without weights or memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config)


def check_lora_targets(model_config, lora_config: LoraConfig) -> dict:
    """Inject the LoRA into a weightless (meta-device) model of the architecture: every target
    must match (a ValueError names the one that does not). No weights are read or allocated."""
    model = weightless_model(model_config)
    wrapped = inject_lora(model, lora_config)
    return {"wrapped_modules": len(wrapped), "architecture": type(model).__name__}


def check_lora_rank(model_config, lora_config: LoraConfig) -> None:
    """A ValueError naming lora.r when it exceeds the smaller side of a Linear it wraps: B A has rank
    at most min(in, out), so a larger r adds parameters and memory (r=10**9 asks for terabytes) and
    nothing a smaller one cannot learn. Read on a weightless model, before anything is allocated."""
    model = weightless_model(model_config)
    inject_lora(model, lora_config)
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        side = min(module.in_features, module.out_features)
        for adapter in module.adapters:
            r = module.lora_A[adapter].weight.shape[0]
            if r > side:
                raise ValueError(f"lora.r {r} exceeds {name}'s smaller side ({module.in_features} in, "
                                 f"{module.out_features} out): an update B A has rank {side} at most there. "
                                 f"Choose lora.r <= {side}")


def check_quantizable(model_config, fmt: str) -> None:
    """A ValueError, naming `model.quantize` and what to do, when the architecture's decoder
    Linears cannot be stored in `fmt` (their shapes, read from a weightless meta-device model)."""
    if fmt == NONE:
        return
    model = weightless_model(model_config)
    problems = quantization_problems(model, fmt)
    if problems:  # the rule is the problem's own words; the way out, the formats that fit this model
        fits = [other for other in FORMATS if other != fmt and not quantization_problems(model, other)]
        instead = (f"set model.quantize to one that fits this model ({', '.join(fits)}) or to none" if fits
                   else "no format fits this model: set model.quantize=none")
        raise ValueError(f"model.quantize={fmt}: cannot store the decoder's " + "; ".join(problems) + f"; {instead}")


def context_length(model_config) -> int | None:
    """The model's context length in tokens (max_position_embeddings), or None if it states none."""
    value = getattr(model_config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def check_new_tokens(max_new_tokens: int, context: int | None, prompt_tokens: int = 0,
                     flag: str = "--max-new-tokens") -> None:
    """Refuse to generate past the model's context before anything is allocated for it (the KV
    cache grows with every token): the prompt and the answer must fit in `context` tokens."""
    if context is not None and prompt_tokens + max_new_tokens > context:
        room = context - prompt_tokens
        raise ModelLoadError(f"{flag} {max_new_tokens}: the prompt ({prompt_tokens} tokens) and the answer would "
                             f"exceed the model's context of {context} tokens; pass {flag} {room} or fewer"
                             if room > 0 else
                             f"the prompt ({prompt_tokens} tokens) fills the model's context of {context} tokens: "
                             "shorten it")


def add_adapter(model, adapter: str | Path, *, merge: bool) -> dict[str, LoraConfig]:
    """Load the PEFT-layout adapter in `adapter` into `model` as its only adapter; with merge,
    fold it into the base weights (W0 += scaling B A, in the model's dtype) and drop the LoRA
    layers. Returns the set of one, {DEFAULT_ADAPTER: its config}."""
    try:
        configs = load_adapters(model, adapter)
        if merge:
            merge_and_unload(model)
    except (FileNotFoundError, ValueError, OSError) as err:
        raise ModelLoadError(f"adapter {adapter}: {err}") from None
    return configs


def load_model(path: str | Path, adapters: list[str | Path] = (), dtype: torch.dtype = torch.float32,
               keep_last: bool = False, warn=None, quantize: str = NONE, token_rows: tuple[int, int] | None = None,
               tokenizer: str | Path | None = None):
    """The base in `path` with `adapters` merged in order. keep_last: the last adapter stays a
    trainable LoRA (not merged). Returns (model, the last adapter's set of one {DEFAULT_ADAPTER:
    its LoraConfig}, or None when none is kept).

    quantize: the decoder Linears' format (model.quantize, quantized_base.py), applied after the
    merges (an adapter merges into the full-precision weights, as QLoRA users merge) and before
    the kept adapter wraps them.

    token_rows: (first new id, how many) new tokens' rows the base gets first (new_tokens.py:
    model.new_tokens); None: those an adapter's own tokenizer asks for (an adapter trained with new
    tokens holds its tokenizer), against the base's tokenizer (`tokenizer`, default `path`).

    Each adapter must lie on what it was trained on (lineage.py): other adapters beneath it are
    a ModelLoadError; another base is a warning, to `warn` (default: stderr)."""
    warn = warn or (lambda message: print(message, file=sys.stderr, flush=True))
    check_stack(path, adapters, warn)
    kept = adapters[-1:] if keep_last else []
    merged = adapters[:len(adapters) - len(kept)]
    model = load_base(path, dtype, quantize=NONE if merged else quantize)  # a merge needs the full weights
    if token_rows is None and adapters:
        token_rows = token_rows_of(tokenizer or path, adapters)
    if token_rows is not None:
        add_token_rows(model, *token_rows)  # before a merge: merged adapters may hold those rows
    for adapter in merged:
        fmt = trained_quantized(adapter)
        if fmt:
            warn(f"adapter {adapter} was trained on the base stored as {fmt} (model.quantize); it is merged into "
                 "the base's full-precision weights, as QLoRA adapters are: close to, not equal to, what it trained on")
        add_adapter(model, adapter, merge=True)
    if merged:
        quantize_base(model, quantize)
    configs = add_adapter(model, kept[0], merge=False) if kept else None
    return model, configs
