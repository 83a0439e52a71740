"""`model.quantize`: store the frozen base's decoder Linears block-quantized (q8_0, q4_0, nf4)
under the LoRA, so a 7B-9B model fits one 16 GiB chip (QLoRA on PyTorch/XLA).

Every `nn.Linear` inside the decoder layers becomes a `QuantizedLinear` (lora_logic/
quantized_linear.py); the embeddings, the LM head and the norms stay in `model.dtype`. The
values quantized are the base's weights as loaded in `model.dtype` (a bf16 checkpoint loaded in
bf16: the file's own values). Quantize before the LoRA is injected: the LoRA then wraps the
quantized layers, and its A and B stay full-precision master weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from lora_logic.quantize import dequantize, quantization_problem, stored_bytes
from lora_logic.quantized_linear import QuantizedLinear, is_linear

NONE = "none"


def decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every `nn.Linear` of the base inside the model's decoder layers (a LoRA's
    own A and B are not the base's)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no list of decoder layers at get_decoder().layers to quantize")
    prefix = next(name for name, module in model.named_modules() if module is layers)
    return [(f"{prefix}.{name}", module) for name, module in layers.named_modules()
            if isinstance(module, nn.Linear) and not _in_lora(name)]


def _in_lora(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def quantization_problems(model: nn.Module, fmt: str) -> list[str]:
    """Why the decoder Linears of `model` (a meta-device model will do) cannot be stored in `fmt`,
    one line per distinct problem; [] when they can."""
    if fmt == NONE:
        return []
    problems = {}
    for name, linear in decoder_linears(model):
        problem = quantization_problem(fmt, tuple(linear.weight.shape))
        if problem:
            problems.setdefault(problem, name.rsplit(".", 1)[-1])
    return [f"{leaf} ({problem})" for problem, leaf in problems.items()]


def quantize_base(model: nn.Module, fmt: str) -> int:
    """Replace every decoder Linear of `model` by its quantized form in `fmt`, one at a time (the
    full-precision weight is freed as the next is made); returns how many. `none`: nothing."""
    if fmt == NONE:
        return 0
    problems = quantization_problems(model, fmt)
    if problems:
        raise ValueError(f"model.quantize={fmt}: cannot store " + "; ".join(problems))
    linears = decoder_linears(model)
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        quantized = QuantizedLinear.from_linear(linear, fmt).to(linear.weight.device)
        quantized.train(linear.training)
        setattr(parent, child, quantized)
    return len(linears)


def decoder_weight_bytes(model: nn.Module) -> int:
    """Bytes the decoder Linears' weights take as stored: codes and scales where quantized, the
    weight where not (what `model.quantize` shrinks; biases, norms, embeddings and the LoRA's own
    A and B aside)."""
    layers = model.get_decoder().layers
    return sum(stored_bytes(module.quantized) if isinstance(module, QuantizedLinear)
               else module.weight.numel() * module.weight.element_size()
               for name, module in layers.named_modules() if is_linear(module) and not _in_lora(name))


def quantized_summary(model: nn.Module) -> dict | None:
    """What the base's decoder Linears hold on the device, quantized: {"format", "linears",
    "weight_bytes", "bf16_bytes"} (the same weights in bf16); None when none is quantized."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]  # a model without them: any layout
    if not layers:
        return None
    return {"format": layers[0].format, "linears": len(layers), "weight_bytes": decoder_weight_bytes(model),
            "bf16_bytes": sum(2 * m.in_features * m.out_features for m in layers)}


def write_dequantized_copy(model_dir: Path, fmt: str, dtype: torch.dtype, out: Path) -> Path:
    """A copy of the model in `model_dir` (its config, weights and tokenizer) whose decoder
    Linears hold, in fp32, the dequantized weights a run in `dtype` with model.quantize=`fmt`
    computes with: the unquantized model that a quantized run must equal, step for step."""
    from transformers import AutoModelForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    quantize_base(quantized, fmt)
    stored = dict(quantized.named_modules())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, linear in decoder_linears(model):
            linear.weight.copy_(dequantize(stored[name].quantized, torch.float32))
    # The config and tokenizer files; the weights are the ones saved here (in as many shards as they take).
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json"))
    model.save_pretrained(out)
    return out
